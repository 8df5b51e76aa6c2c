"""The OpenAI-compatible and native endpoints of a live `kvstrata serve`, driven by the
official `openai` client and httpx: greedy outputs equal the offline engine's token for
token, usage (with the kvstrata breakdown) matches the Prometheus counters, prefix hits
are reported and change nothing, and concurrent streams leave no page behind."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    NUM_KV_PAGES,
    PAGE_SIZE,
    ServerProcess,
    assert_idle,
    sse_events,
    wait_until_idle,
)

from kvstrata import LLM, SamplingParams
from kvstrata.core import RequestOutput

PROMPT = "The keeper climbed the stairs every evening to light the great lamp."
KVSTRATA_USAGE_KEYS = {
    "cached_tokens_l1", "cached_tokens_l2", "cached_tokens_l3", "transferred_tokens",
    "local_prefill_tokens", "rank",
}  # fmt: skip


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    """The offline engine with the server's engine configuration."""
    return LLM(
        str(tiny_llama), page_size=PAGE_SIZE, max_model_len=MAX_MODEL_LEN,
        num_kv_pages=NUM_KV_PAGES,
    )  # fmt: skip


@pytest.fixture()
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def offline(llm: LLM, prompt_ids: list[list[int]], max_tokens: int) -> list[RequestOutput]:
    return llm.generate(
        input_ids=prompt_ids, sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0)
    )


def usage_dict(usage: object) -> dict:
    return json.loads(usage.model_dump_json())  # type: ignore[attr-defined]


def check_usage(usage: dict, prompt_len: int, completion_len: int) -> None:
    assert usage["prompt_tokens"] == prompt_len
    assert usage["completion_tokens"] == completion_len
    assert usage["total_tokens"] == prompt_len + completion_len
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    kv = usage["kvstrata"]
    assert set(kv) == KVSTRATA_USAGE_KEYS
    assert kv["cached_tokens_l1"] + kv["cached_tokens_l2"] + kv["cached_tokens_l3"] == cached
    assert kv["cached_tokens_l2"] == kv["cached_tokens_l3"] == kv["transferred_tokens"] == 0
    assert kv["rank"] == 0


def test_models_and_server_info(client: openai.OpenAI, http: httpx.Client) -> None:
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    info = http.get("/server_info").json()
    assert info["page_size"] == PAGE_SIZE
    assert info["max_model_len"] == MAX_MODEL_LEN
    assert info["num_total_pages"] == NUM_KV_PAGES
    assert "api_key" not in info["server_config"]


def test_completion_equals_offline_engine(
    client: openai.OpenAI, http: httpx.Client, llm: LLM
) -> None:
    prompt_ids = llm.tokenizer.encode(PROMPT)
    (expected,) = offline(llm, [prompt_ids], 12)
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason.value
    check_usage(usage_dict(resp.usage), len(prompt_ids), len(expected.output_ids))
    assert resp.usage.kvstrata["rank"] == 0  # extra fields stay reachable on the client

    by_ids = client.completions.create(
        model=MODEL_NAME, prompt=prompt_ids, max_tokens=12, temperature=0
    )
    assert by_ids.choices[0].text == expected.text
    native = http.post(
        "/generate",
        json={"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}},
    ).json()
    assert native["output_ids"] == expected.output_ids
    assert native["text"] == expected.text
    check_usage(native["usage"], len(prompt_ids), len(expected.output_ids))
    native_text = http.post(
        "/generate",
        json={"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}},
    ).json()
    assert native_text["output_ids"] == expected.output_ids


def test_batched_completion_prompts(client: openai.OpenAI, llm: LLM) -> None:
    prompts = ["A page holds sixteen tokens", "The router sends each request"]
    expected = offline(llm, [llm.tokenizer.encode(p) for p in prompts], 8)
    resp = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [out.text for out in expected]
    assert resp.usage.completion_tokens == sum(len(out.output_ids) for out in expected)


def test_chat_equals_offline_engine(client: openai.OpenAI, llm: LLM) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me about the lighthouse keeper."},
    ]
    prompt_ids = llm.tokenizer.apply_chat_template(messages)
    (expected,) = offline(llm, [prompt_ids], 10)
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0
    )
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    check_usage(usage_dict(resp.usage), len(prompt_ids), len(expected.output_ids))


def test_streaming_equals_non_streaming(client: openai.OpenAI, llm: LLM) -> None:
    messages = [{"role": "user", "content": "How can I help you today?"}]
    prompt_ids = llm.tokenizer.apply_chat_template(messages)
    (chat_expected,) = offline(llm, [prompt_ids], 9)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_expected.text
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [chat_expected.finish_reason.value]
    assert chunks[-1].choices == []
    check_usage(usage_dict(chunks[-1].usage), len(prompt_ids), len(chat_expected.output_ids))

    (completion_expected,) = offline(llm, [llm.tokenizer.encode(PROMPT)], 11)
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=11, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == completion_expected.text
    assert all(c.usage is None for c in chunks)  # include_usage was not asked for


def test_prefix_hit_reports_cached_tokens_and_same_output(
    client: openai.OpenAI, http: httpx.Client, llm: LLM
) -> None:
    assert http.post("/flush_cache", params={"wait": "true"}).status_code == 200
    first = "The router sends each request to the worker that already holds its longest prefix."
    second = first + " Prefill reads the whole prompt at once; decode adds one token at a time."
    client.completions.create(model=MODEL_NAME, prompt=first, max_tokens=4, temperature=0)
    hit = client.completions.create(model=MODEL_NAME, prompt=second, max_tokens=10, temperature=0)
    cached = hit.usage.prompt_tokens_details.cached_tokens
    assert cached >= PAGE_SIZE and cached % PAGE_SIZE == 0
    assert hit.usage.kvstrata["cached_tokens_l1"] == cached

    assert http.post("/flush_cache").json() == {"flushed": True}
    miss = client.completions.create(model=MODEL_NAME, prompt=second, max_tokens=10, temperature=0)
    assert miss.usage.prompt_tokens_details.cached_tokens == 0
    assert miss.choices[0].text == hit.choices[0].text
    (expected,) = offline(llm, [llm.tokenizer.encode(second)], 10)
    assert hit.choices[0].text == expected.text


def test_usage_matches_prometheus_counters(client: openai.OpenAI, http: httpx.Client) -> None:
    before = scrape(http)
    a = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0)
    b = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=7, temperature=0)
    after = scrape(http)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("kvstrata_prompt_tokens_total") == a.usage.prompt_tokens + b.usage.prompt_tokens
    assert delta("kvstrata_generation_tokens_total") == (
        a.usage.completion_tokens + b.usage.completion_tokens
    )
    assert delta('kvstrata_cached_tokens_total{tier="l1"}') == (
        a.usage.kvstrata["cached_tokens_l1"] + b.usage.kvstrata["cached_tokens_l1"]
    )
    assert delta("kvstrata_time_to_first_token_seconds_count") == 2
    finished = sum(v for k, v in after.items() if k.startswith("kvstrata_requests_total"))
    assert (
        finished - sum(v for k, v in before.items() if k.startswith("kvstrata_requests_total")) == 2
    )
    load = http.get("/get_load").json()
    assert after['kvstrata_kv_pages{state="free"}'] == load["num_free_pages"]
    assert after['kvstrata_kv_pages{state="cached"}'] == load["num_cached_pages"]
    assert after["kvstrata_running_requests"] == 0


def test_gateway_api_inference_extension_metrics(client: openai.OpenAI, http: httpx.Client) -> None:
    """The endpoint picker's default names (vLLM's) carry the same queue, running batch
    and L1 page use as the rank's own gauges in every scrape, busy or idle."""

    def check(sample: dict[str, float]) -> None:
        assert sample["vllm:num_requests_running"] == sample["kvstrata_running_requests"]
        assert sample["vllm:num_requests_waiting"] == sample["kvstrata_waiting_requests"]
        pages = {state: sample[f'kvstrata_kv_pages{{state="{state}"}}'] for state in STATES}
        usage = pages["used"] / sum(pages.values())
        assert sample["vllm:kv_cache_usage_perc"] == sample["vllm:gpu_cache_usage_perc"] == usage
        config = (
            f'vllm:cache_config_info{{block_size="{PAGE_SIZE}",num_gpu_blocks="{NUM_KV_PAGES}"}}'
        )
        assert sample[config] == 1

    with client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=64, temperature=0, stream=True
    ) as stream:
        next(iter(stream))
        check(scrape(http))
    wait_until_idle(http)
    idle = scrape(http)
    check(idle)
    assert idle["vllm:num_requests_running"] == idle["vllm:kv_cache_usage_perc"] == 0


STATES = ("free", "cached", "used")


def scrape(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def test_64_concurrent_streams_complete_correctly(
    server: ServerProcess, http: httpx.Client, llm: LLM
) -> None:
    prompts = [f"Request {i}: the keeper counted {i} ships near the shore." for i in range(64)]
    expected = offline(llm, [llm.tokenizer.encode(p) for p in prompts], 16)

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, dict]:
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        text, usage = "", {}
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            if chunk.usage is not None:
                usage = usage_dict(chunk.usage)
        return text, usage

    async def run_all() -> list[tuple[str, dict]]:
        async with openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(run_all())
    assert [text for text, _ in results] == [out.text for out in expected]
    assert [u["completion_tokens"] for _, u in results] == [len(o.output_ids) for o in expected]
    assert_idle(http)


def test_native_streaming(http: httpx.Client, llm: LLM) -> None:
    prompt_ids = llm.tokenizer.encode(PROMPT)
    (expected,) = offline(llm, [prompt_ids], 6)
    body = {
        "input_ids": prompt_ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0},
    }
    with http.stream("POST", "/generate", json=body) as resp:
        events = list(sse_events(resp))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [t for c in chunks for t in c["output_ids"]] == expected.output_ids
    assert "".join(c["text"] for c in chunks) == expected.text
    assert chunks[-1]["usage"]["completion_tokens"] == len(expected.output_ids)
