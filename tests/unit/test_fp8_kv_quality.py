"""FP8 KV on a real checkpoint (SmolLM2-135M-Instruct, fp32 compute, CPU): perplexity of
2,048 tokens of English text (the GPL-3 text every Debian system ships) with e4m3 KV
pages with scales calibrated on another text (Apache-2.0, 1,024 tokens) is within +2% of
bf16 KV pages (the issue's bound), and with unit scales within +3%; greedy agreement
over 8 prompts is reported (32 took half of this test's 80 s and assert nothing)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from real_model import smollm2  # noqa: F401 - the session fixture

from kvstrata import LLM, SamplingParams
from kvstrata.model.tokenizer import Tokenizer

TEXT = Path("/usr/share/common-licenses/GPL-3")
CALIBRATION_TEXT = Path("/usr/share/common-licenses/Apache-2.0")
SETTINGS = {
    "fp32": {"kv_cache_dtype": "auto"},
    "bf16": {"kv_cache_dtype": "bf16"},
    "e4m3": {"kv_cache_dtype": "fp8_e4m3"},
    "e4m3 calibrated": {
        "kv_cache_dtype": "fp8_e4m3",
        "kv_scales_calibrate": 1024,
        "kv_scales_text": str(CALIBRATION_TEXT),
    },
}
NUM_TOKENS = 2048
NUM_PROMPTS = 8  # greedy prompts of 40 tokens, spread over the text
CHUNK = 256  # prefill chunks: later chunks attend to the earlier chunks' stored KV


def perplexity(llm: LLM, token_ids: list[int]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (out,) = llm.generate(input_ids=[token_ids], sampling_params=params)
    assert out.prompt_logprobs is not None
    logprobs = [record.logprob for record in out.prompt_logprobs]
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.mark.skipif(
    not (TEXT.is_file() and CALIBRATION_TEXT.is_file()),
    reason=f"{TEXT} or {CALIBRATION_TEXT} (Debian's base-files) is absent",
)
def test_e4m3_kv_perplexity_within_two_percent_of_bf16_kv(smollm2: Path) -> None:  # noqa: F811
    token_ids = Tokenizer(smollm2).encode(TEXT.read_text(), add_special_tokens=False)
    token_ids = token_ids[:NUM_TOKENS]
    prompts = [token_ids[i * 240 : i * 240 + 40] for i in range(NUM_PROMPTS)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ppl, outputs = {}, {}
    for name, kv_flags in SETTINGS.items():
        with LLM(
            str(smollm2),
            dtype="float32",
            page_size=16,
            num_kv_pages=512,
            max_num_batched_tokens=CHUNK,
            **kv_flags,
        ) as llm:
            ppl[name] = perplexity(llm, token_ids)
            outs = llm.generate(input_ids=prompts, sampling_params=greedy)
            outputs[name] = [out.output_ids for out in outs]
    print(f"\nperplexity over {len(token_ids)} tokens: fp32 KV {ppl['fp32']:.3f}")
    for name in ("bf16", "e4m3", "e4m3 calibrated"):
        pairs = list(zip(outputs["fp32"], outputs[name]))
        agree = sum(a == b for a, b in pairs)
        tokens_agree = sum(x == y for a, b in pairs for x, y in zip(a, b))
        print(
            f"{name} KV {ppl[name]:.3f} ({ppl[name] / ppl['fp32'] - 1:+.2%} of fp32, "
            f"{ppl[name] / ppl['bf16'] - 1:+.2%} of bf16); greedy against fp32 KV: "
            f"{agree}/{NUM_PROMPTS} prompts identical over 16 tokens, "
            f"{tokens_agree}/{NUM_PROMPTS * 16} tokens"
        )
    assert ppl["e4m3 calibrated"] <= 1.02 * ppl["bf16"]
    # Unit scales leave this small model's V (|V| < 6) partly subnormal in e4m3: +2.1%
    # of bf16 here (2,048 and 6,144 tokens alike), so its bound is looser.
    assert ppl["e4m3"] <= 1.03 * ppl["bf16"]
