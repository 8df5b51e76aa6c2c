"""FP8 KV on a real checkpoint (SmolLM2-135M-Instruct, fp32 compute, CPU): perplexity of
2,048 tokens of English text (the GPL-3 text every Debian system ships) with e4m3 KV
pages is within +2% of fp32 KV pages; greedy agreement over 32 prompts is reported."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from real_model import smollm2  # noqa: F401 - the session fixture

from kvstrata import LLM, SamplingParams
from kvstrata.model.tokenizer import Tokenizer

TEXT = Path("/usr/share/common-licenses/GPL-3")
NUM_TOKENS = 2048
CHUNK = 256  # prefill chunks: later chunks attend to the earlier chunks' stored KV


def perplexity(llm: LLM, token_ids: list[int]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (out,) = llm.generate(input_ids=[token_ids], sampling_params=params)
    assert out.prompt_logprobs is not None
    logprobs = [record.logprob for record in out.prompt_logprobs]
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.mark.skipif(not TEXT.is_file(), reason=f"{TEXT} (Debian's base-files) is absent")
def test_e4m3_kv_perplexity_within_two_percent_of_fp32(smollm2: Path) -> None:  # noqa: F811
    token_ids = Tokenizer(smollm2).encode(TEXT.read_text(), add_special_tokens=False)
    token_ids = token_ids[:NUM_TOKENS]
    prompts = [token_ids[i * 60 : i * 60 + 40] for i in range(32)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ppl, outputs = {}, {}
    for kv in ("auto", "fp8_e4m3"):
        with LLM(
            str(smollm2),
            dtype="float32",
            kv_cache_dtype=kv,
            page_size=16,
            num_kv_pages=512,
            max_num_batched_tokens=CHUNK,
        ) as llm:
            ppl[kv] = perplexity(llm, token_ids)
            outs = llm.generate(input_ids=prompts, sampling_params=greedy)
            outputs[kv] = [out.output_ids for out in outs]
    agree = sum(a == b for a, b in zip(outputs["auto"], outputs["fp8_e4m3"]))
    tokens_agree = sum(
        x == y for a, b in zip(outputs["auto"], outputs["fp8_e4m3"]) for x, y in zip(a, b)
    )
    print(
        f"\nperplexity over {len(token_ids)} tokens: fp32 KV {ppl['auto']:.3f}, e4m3 KV "
        f"{ppl['fp8_e4m3']:.3f} ({ppl['fp8_e4m3'] / ppl['auto'] - 1:+.2%}); greedy: "
        f"{agree}/32 prompts identical over 16 tokens, {tokens_agree}/{32 * 16} tokens"
    )
    assert ppl["fp8_e4m3"] <= 1.02 * ppl["auto"]
