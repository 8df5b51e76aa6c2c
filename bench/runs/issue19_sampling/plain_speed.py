"""Decode throughput of 64 requests x 128 tokens (argv: model dir, label, and plain |
penalties | logprobs, greedy, or sampled | seeded: temperature 0.8, top_p 0.95, seed 7
for seeded); only APIs that existed before issue 19 on the plain path (issue 27 measures
sampled and seeded decode with it too)."""

from __future__ import annotations

import random
import sys
import time

import torch

from kvstrata import LLM, SamplingParams

model, label = sys.argv[1], sys.argv[2]
mode = sys.argv[3] if len(sys.argv) > 3 else "plain"
llm = LLM(model, page_size=16, num_kv_pages=4096)
rng = random.Random(0)
prompts = [[rng.randrange(1, 500) for _ in range(32)] for _ in range(64)]
fields: dict = {"max_tokens": 128, "temperature": 0.0, "ignore_eos": True}
if mode == "penalties":
    fields |= {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.3}
elif mode == "logprobs":
    fields |= {"logprobs": 5}
elif mode in ("sampled", "seeded"):
    fields |= {"temperature": 0.8, "top_p": 0.95, "seed": 7 if mode == "seeded" else None}
params = SamplingParams(**fields)
llm.generate(input_ids=prompts[:8], sampling_params=params)  # warm-up (graphs, kernels)
times = []
for _ in range(3):
    torch.cuda.synchronize()
    start_s = time.perf_counter()
    outs = llm.generate(input_ids=prompts, sampling_params=params)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start_s)
num_tokens = sum(len(o.output_ids) for o in outs)
print(f"{label} {mode}: {num_tokens} tokens, best {min(times):.3f} s, median "
      f"{sorted(times)[1]:.3f} s -> {num_tokens / min(times):.0f} tok/s")  # fmt: skip
