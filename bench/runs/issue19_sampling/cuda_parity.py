"""On CUDA: penalties, bias, min_tokens, logprobs, n and echo's prompt logprobs give the
same tokens (and logprobs within 1e-3) with CUDA graphs + overlap on as with both off
(fp32 tiny model); prints PARITY OK or FAIL."""

from __future__ import annotations

import gc
import random
import tempfile

import torch

from kvstrata import LLM, SamplingParams
from kvstrata.model.tiny import make_tiny_model

model = make_tiny_model(tempfile.mkdtemp(), arch="llama", seed=0)
rng = random.Random(1)
prompts = [[rng.randrange(1, 400) for _ in range(n)] for n in (5, 17, 40, 9, 64, 3)]
params = [
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, repetition_penalty=1.5,
                   frequency_penalty=0.8, presence_penalty=0.4, logit_bias={3: 2.0}, logprobs=3),
    SamplingParams(max_tokens=20, temperature=0.0, min_tokens=10, logit_bias={514: 50.0}),
    SamplingParams(max_tokens=20, temperature=0.8, seed=4, ignore_eos=True, n=3, logprobs=1),
    SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=2),
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
]  # fmt: skip
results = {}
for graphs in (True, False):
    overlap = "on" if graphs else "off"
    llm = LLM(str(model), page_size=4, dtype="float32", device="cuda", num_kv_pages=4096,
              disable_cuda_graph=not graphs, overlap_schedule=overlap)  # fmt: skip
    results[graphs] = llm.generate(input_ids=prompts, sampling_params=params)
    llm.engine.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def close(a: list | None, b: list | None) -> bool:
    return (a is None) == (b is None) and all(
        abs(x.logprob - y.logprob) < 1e-3 for x, y in zip(a or [], b or [])
    )


ok = True
for a, b in zip(results[True], results[False]):
    same = a.output_ids == b.output_ids
    both = close(a.logprobs, b.logprobs) and close(a.prompt_logprobs, b.prompt_logprobs)
    print(a.rid, "tokens equal", same, "logprobs close", both)
    ok &= same and both
print("PARITY", "OK" if ok else "FAIL")
