"""The engine of one rank: scheduling, model execution, sampling, stopping."""
