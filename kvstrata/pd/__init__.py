"""The network halves of the PD handoff: the prefill rank's /pd endpoints and room table,
the decode rank's sender of rooms with its failure policy and its watch over prefill ranks
(the engine-thread halves are in `kvstrata/disagg`)."""
