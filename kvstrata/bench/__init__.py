"""`kvstrata bench`: drives multi-turn, shared-prefix, trace and agentic (sessions of
tool-calling turns) workloads through any OpenAI-compatible server (token ids through
/generate when it is kvstrata) and reports latency, throughput and where the prompt tokens
were served from."""
