"""`kvstrata simulate`: a discrete-event simulation of decode ranks behind the router, run
on a request trace with the real routing policies, worker registry, radix/host caches
(metadata only) and cache digests, and a per-token cost model for time to first token; or
(`--workload agentic`) the cache policies over agent sessions with the real session table."""
