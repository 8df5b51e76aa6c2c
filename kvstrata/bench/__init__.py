"""`kvstrata bench`: drives multi-turn, shared-prefix and trace workloads through any
OpenAI-compatible server (token ids through /generate when it is kvstrata) and reports
latency, throughput and where the prompt tokens were served from."""
