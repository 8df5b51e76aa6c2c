"""The sampling features on a live rank, against the offline engine on the same model:
logprobs in chat's and completions' shapes (whole and streamed, which agree), `n` choices
with their numbering and usage (each prompt counted once), penalties / logit_bias /
min_tokens on every API, echo, /generate's logprobs, and all of it through a PD pair.
Nothing leaks."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
from pd_harness import assert_rank_idle, start_decode, start_prefill
from server_harness import MAX_MODEL_LEN, PAGE_SIZE, assert_idle, sse_events

from kvstrata import LLM, SamplingParams
from kvstrata.core import RequestOutput

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Tell me about caches"}]
KNOBS = {"presence_penalty": 0.5, "frequency_penalty": 1.5, "repetition_penalty": 2.0,
         "logit_bias": {"17": 8.0}, "min_tokens": 6}  # fmt: skip


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), page_size=PAGE_SIZE, max_model_len=MAX_MODEL_LEN)


def prompt_ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 400) for _ in range(length)]


def offline(llm: LLM, prompt: list[int], **params: Any) -> RequestOutput:
    bias = params.pop("logit_bias", {})
    (out,) = llm.generate(
        input_ids=[prompt],
        sampling_params=SamplingParams(logit_bias={int(k): v for k, v in bias.items()}, **params),
    )
    return out


def streamed(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", path, json=body | {"stream": True}) as response:
        assert response.status_code == 200
        events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def generate_greedy(
    http: httpx.Client,
    prompt: list[int],
    knobs: dict[str, Any],
    max_new_tokens: int,
    top_logprobs_num: int,
) -> dict[str, Any]:
    """/generate with the OpenAI-named `knobs` (min_tokens is min_new_tokens there)."""
    native = {k: v for k, v in knobs.items() if k != "min_tokens"}
    native |= {"min_new_tokens": knobs["min_tokens"], "max_new_tokens": max_new_tokens,
               "temperature": 0}  # fmt: skip
    body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": top_logprobs_num,
            "sampling_params": native}  # fmt: skip
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_logprobs_equal_the_engine_whole_and_streamed(http: httpx.Client, llm: LLM) -> None:
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 3, "ignore_eos": True}  # fmt: skip
    whole = http.post(CHAT, json=body).json()
    (choice,) = whole["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"] == 6
    ids = llm.tokenizer.apply_chat_template([dict(m) for m in MESSAGES], add_generation_prompt=True)
    ref = offline(llm, ids, max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    assert ref.logprobs is not None
    for entry, record in zip(content, ref.logprobs):
        assert entry["token"] == llm.tokenizer.decode([record.token_id], skip_special_tokens=False)
        assert entry["bytes"] == list(entry["token"].encode())
        assert abs(entry["logprob"] - record.logprob) < 1e-4
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]  # greedy: the top one
    chunks = streamed(http, CHAT, body)
    pieces = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    assert [e for p in pieces if p for e in p["content"]] == content
    assert (
        "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        == choice["message"]["content"]
    )
    assert_idle(http)


def test_completion_logprobs_shape_streamed_and_echo(http: httpx.Client, llm: LLM) -> None:
    prompt = prompt_ids(1, 12)
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 2,
            "ignore_eos": True}  # fmt: skip
    (choice,) = http.post(COMPLETIONS, json=body).json()["choices"]
    lp = choice["logprobs"]
    ref = offline(llm, prompt, max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    assert ref.logprobs is not None
    assert lp["tokens"] == [
        llm.tokenizer.decode([t], skip_special_tokens=False) for t in ref.output_ids
    ]
    for logprob, record in zip(lp["token_logprobs"], ref.logprobs):
        assert abs(logprob - record.logprob) < 1e-4
    for top, token in zip(lp["top_logprobs"], lp["tokens"]):
        assert token in top and 2 <= len(top) <= 3  # the sampled token is always listed
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert lp["text_offset"] == offsets
    pieces = [c["choices"][0]["logprobs"] for c in streamed(http, COMPLETIONS, body)]
    assert [t for p in pieces if p for t in p["tokens"]] == lp["tokens"]
    assert [o for p in pieces if p for o in p["text_offset"]] == lp["text_offset"]
    # echo: the prompt text leads the choice (whole and as the stream's first event)
    text = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "echo": True}
    (echoed,) = http.post(COMPLETIONS, json=text).json()["choices"]
    plain = http.post(COMPLETIONS, json=text | {"echo": False}).json()["choices"][0]["text"]
    assert echoed["text"] == "Once upon a time" + plain
    first = streamed(http, COMPLETIONS, text)[0]["choices"][0]
    assert first["text"] == "Once upon a time"
    assert_idle(http)


def test_echo_with_logprobs_leads_with_the_prompts(http: httpx.Client, llm: LLM) -> None:
    prompt = prompt_ids(5, 11)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True,
            "ignore_eos": True}  # fmt: skip
    (choice,) = http.post(COMPLETIONS, json=body).json()["choices"]
    lp = choice["logprobs"]
    ref = offline(llm, prompt, max_tokens=4, temperature=0, ignore_eos=True, logprobs=1,
                  prompt_logprobs=1)  # fmt: skip
    assert ref.prompt_logprobs is not None and ref.logprobs is not None
    all_ids = ref.prompt_ids + ref.output_ids
    texts = [llm.tokenizer.decode([t], skip_special_tokens=False) for t in all_ids]
    assert lp["tokens"] == texts
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing before
    for logprob, record in zip(lp["token_logprobs"][1:], ref.prompt_logprobs + ref.logprobs):
        assert abs(logprob - record.logprob) < 1e-4
    assert lp["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert choice["text"].endswith(ref.text)
    chunks = [c["choices"][0] for c in streamed(http, COMPLETIONS, body)]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]] == texts
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == lp["text_offset"]
    assert_idle(http)


def test_n_choices_numbering_and_usage(http: httpx.Client, llm: LLM) -> None:
    prompts = [prompt_ids(2, 9), prompt_ids(3, 14)]
    body = {"prompt": prompts, "n": 3, "best_of": 3, "max_tokens": 6, "temperature": 1.0,
            "seed": 11, "ignore_eos": True}  # fmt: skip
    whole = http.post(COMPLETIONS, json=body).json()
    assert [c["index"] for c in whole["choices"]] == list(range(6))
    usage = whole["usage"]
    assert usage["prompt_tokens"] == 9 + 14  # each prompt once
    assert usage["completion_tokens"] == 6 * 6
    texts = [c["text"] for c in whole["choices"]]
    assert len(set(texts[:3])) > 1  # the choices of one prompt are not copies
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True, n=3)
    ref = llm.generate(input_ids=prompts, sampling_params=seeded)
    assert texts == [o.text for o in ref]
    chunks = streamed(http, COMPLETIONS, body | {"stream_options": {"include_usage": True}})
    by_index: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for c in chunk["choices"]:
            by_index[c["index"]] = by_index.get(c["index"], "") + c["text"]
    assert [by_index[i] for i in range(6)] == texts
    assert chunks[-1]["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    assert chunks[-1]["usage"]["completion_tokens"] == usage["completion_tokens"]
    chat = http.post(CHAT, json={"messages": MESSAGES, "n": 2, "max_tokens": 3,
                                 "temperature": 0}).json()  # fmt: skip
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert chat["choices"][0]["message"] == chat["choices"][1]["message"]  # greedy
    roles = [c["choices"][0] for c in streamed(http, CHAT, {"messages": MESSAGES, "n": 2,
                                                             "max_tokens": 3})][:2]  # fmt: skip
    assert [(r["index"], r["delta"]["role"]) for r in roles] == [(0, "assistant"), (1, "assistant")]
    assert_idle(http)


def test_penalties_bias_and_min_tokens_equal_offline_on_every_api(
    http: httpx.Client, llm: LLM
) -> None:
    prompt = prompt_ids(4, 20)
    first = offline(llm, prompt, max_tokens=10, temperature=0)
    prompt = prompt + first.output_ids[:4]  # tokens for the repetition penalty to find
    plain = offline(llm, prompt, max_tokens=10, temperature=0, logprobs=2)
    assert plain.logprobs is not None
    (_, top_logprob), (runner_up, runner_up_logprob) = plain.logprobs[0].top
    # The tiny model repeats little: a bias that lifts the first step's runner-up past
    # the top token makes sure the knobs change the answer.
    knobs = dict(KNOBS, logit_bias={str(runner_up): top_logprob - runner_up_logprob + 1.0})
    ref = offline(llm, prompt, max_tokens=10, temperature=0, **dict(knobs))
    assert ref.output_ids[0] == runner_up and ref.output_ids != plain.output_ids
    generated = generate_greedy(http, prompt, knobs, 10, top_logprobs_num=1)
    assert generated["output_ids"] == ref.output_ids
    records = generated["output_token_logprobs"]
    assert [r["token_id"] for r in records] == ref.output_ids
    assert all(len(r["top_logprobs"]) == 1 for r in records)
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0} | knobs
    (choice,) = http.post(COMPLETIONS, json=body).json()["choices"]
    assert choice["text"] == ref.text
    assert_idle(http)


def test_pd_cluster_serves_the_sampling_features(
    tiny_llama: Path, llm: LLM, tmp_path: Path
) -> None:
    """Prefill and decode ranks over HTTP: the prefill rank's first token carries the
    request's adjustments and its logprobs to the decode rank (equal to unified); n
    choices each take a room; echo with logprobs is refused (the prompt is computed
    elsewhere), nothing queued."""
    prefill = start_prefill(tiny_llama, tmp_path / "prefill")
    decode = start_decode(tiny_llama, tmp_path / "decode", [prefill.base_url])
    try:
        with httpx.Client(base_url=decode.base_url, timeout=120) as http:
            prompt = prompt_ids(6, 19)
            knobs = dict(KNOBS, logit_bias={"23": 5.0})
            ref = offline(llm, prompt, max_tokens=8, temperature=0, logprobs=2, **dict(knobs))
            assert ref.logprobs is not None
            body = generate_greedy(http, prompt, knobs, 8, top_logprobs_num=2)
            assert body["output_ids"] == ref.output_ids
            for got, record in zip(body["output_token_logprobs"], ref.logprobs):
                assert abs(got["logprob"] - record.logprob) < 1e-4
                assert [t["token_id"] for t in got["top_logprobs"]] == [t for t, _ in record.top]
            choices = http.post(COMPLETIONS, json={"prompt": prompt, "n": 2, "max_tokens": 4,
                                                   "temperature": 0}).json()  # fmt: skip
            assert len({c["text"] for c in choices["choices"]}) == 1
            assert choices["usage"]["prompt_tokens"] == len(prompt)
            refused = http.post(COMPLETIONS, json={"prompt": prompt, "echo": True, "logprobs": 1})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"
            assert_rank_idle(http)
    finally:
        assert decode.stop() == 0, decode.log()
        assert prefill.stop() == 0, prefill.log()
