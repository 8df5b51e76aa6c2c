"""SmolLM2-135M-Instruct from its GGUF file against transformers' own GGUF loader (fp32,
CPU): the same weights, the same prompt ids (chat template included), prefill logits
within 1e-4 and the same greedy ids, with `LLM(model=FILE.gguf)`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from real_model import smollm2, smollm2_gguf  # noqa: F401 - the session fixture
from test_model import PagedSequence, hf_logits, max_diff

from kvstrata.core import SamplingParams
from kvstrata.llm import LLM
from kvstrata.model.loader import load_model
from kvstrata.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
transformers.logging.set_verbosity_error()

MAX_TOKENS = 24
EOS_ID = 2  # <|im_end|>
ATOL = 1e-4
TEXTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Here are three facts about the moon: 1.",
    "Une phrase en français, s'il vous plaît :",
)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def hf(smollm2: Path) -> tuple[Any, Any]:  # noqa: F811
    """transformers' model and tokenizer, dequantized by its own GGUF loader."""
    gguf = smollm2_gguf(smollm2)
    kwargs = {"gguf_file": gguf.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=torch.float32, **kwargs
    )
    return model.eval(), transformers.AutoTokenizer.from_pretrained(gguf.parent, **kwargs)


@pytest.fixture(scope="module")
def prompts(smollm2: Path, hf: tuple[Any, Any]) -> list[list[int]]:  # noqa: F811
    """The 5 prompts as ids, each equal to what transformers' tokenizer makes of it."""
    tokenizer, hf_tokenizer = Tokenizer(smollm2), hf[1]
    ids = [tokenizer.encode(text) for text in TEXTS]
    assert ids == [hf_tokenizer(text)["input_ids"] for text in TEXTS]
    chat = tokenizer.apply_chat_template(CHAT)
    hf_chat = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert chat == list(getattr(hf_chat, "input_ids", hf_chat))
    return [*ids, chat]


def test_weights_equal_transformers(smollm2: Path, hf: tuple[Any, Any]) -> None:  # noqa: F811
    """Every tensor, dequantized and un-permuted (q/k rows), equals transformers' copy."""
    ours = load_model(smollm2, torch.float32, "cpu").state_dict()
    theirs = hf[0].state_dict()
    assert set(theirs) - set(ours) == {"lm_head.weight"}  # tied: the embedding is the head
    assert max(max_diff(ours[name], theirs[name]) for name in ours) == 0.0


def test_prefill_logits_match(smollm2: Path, hf: tuple[Any, Any], prompts: list[list[int]]) -> None:  # noqa: F811
    model = load_model(smollm2, torch.float32, "cpu")
    worst = max(
        max_diff(PagedSequence(model).extend(ids), hf_logits(hf[0], ids)) for ids in prompts
    )
    print(f"\nmax abs logit diff over {len(prompts)} prompts: {worst:.2e}")
    assert worst < ATOL


def test_greedy_ids_equal_transformers(
    smollm2: Path,  # noqa: F811
    hf: tuple[Any, Any],
    prompts: list[list[int]],
) -> None:
    """`LLM` given the .gguf file itself (not the directory) generates transformers' ids,
    up to the end-of-turn token where there is one (the chat answer stops there)."""
    llm = LLM(str(smollm2_gguf(smollm2)), page_size=16, num_kv_pages=128)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.generate(input_ids=prompts, sampling_params=params)
    ours = [until_eos(out.output_ids) for out in outputs]
    theirs = []
    for ids in prompts:
        out = hf[0].generate(
            torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=EOS_ID
        )
        theirs.append(until_eos(out[0, len(ids) :].tolist()))
    print(f"\ngreedy ids: {ours}")
    assert ours == theirs
    assert outputs[-1].finish_reason == "stop"
    assert llm.tokenizer.decode(ours[-1]) == "The capital of France is Paris."


def until_eos(ids: list[int]) -> list[int]:
    return ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids
