"""KV page transports between a prefill rank and a decode rank."""
