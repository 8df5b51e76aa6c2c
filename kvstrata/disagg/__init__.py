"""Prefill/decode disaggregation: the handoff protocol, KV transports, and the
prefill-side and decode-side queues of a rank."""
