"""Real weights through real processes: `kvstrata serve --model FILE.gguf` (SmolLM2-135M-
Instruct) answers the OpenAI chat endpoint with the model's own template, stops at stop
strings, streams multi-byte text without broken characters; a 1 prefill + 2 decode
cluster with L1+L2+L3 gives a 4-turn chat the same text as unified greedy generation.
(`n` > 1 and logprobs do not exist in kvstrata yet: nothing to test.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from real_model import smollm2, smollm2_gguf  # noqa: F401 - the session fixture
from server_harness import ServerProcess, sse_events, start_server

from kvstrata.cluster.launch import launch_cluster
from kvstrata.cluster.launch_config import LaunchConfig
from kvstrata.core import SamplingParams
from kvstrata.llm import LLM

NAME = "smollm2"
FLAGS = ("--page-size", "16", "--num-kv-pages", "256", "--max-model-len", "2048",
         "--log-level", "warning")  # fmt: skip
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
JAPANESE = [{"role": "user", "content": "How do you say 'thank you' in Japanese? Answer with "
             "the Japanese characters."}]  # fmt: skip
QUESTIONS = (
    "What is the capital of France?",
    "What is it famous for?",
    "Name one museum there.",
    "Thank you! Summarize our chat in one sentence.",
)
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def llm(smollm2: Path) -> LLM:  # noqa: F811
    """The unified in-process reference (same page size as the servers)."""
    return LLM(str(smollm2), page_size=16, num_kv_pages=256, max_model_len=2048)


@pytest.fixture(scope="module")
def server(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:  # noqa: F811
    logs = tmp_path_factory.mktemp("real-model-logs")
    started = start_server(smollm2_gguf(smollm2), logs, "--served-model-name", NAME, *FLAGS)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        yield client


def reference(llm: LLM, messages: list[dict[str, str]], max_tokens: int = MAX_TOKENS) -> str:
    ids = llm.tokenizer.apply_chat_template(messages)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return llm.generate(input_ids=[ids], sampling_params=params)[0].text


def chat(http: httpx.Client, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    body = {"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS, **extra}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


# First: the module's `server` starts with the next test, so the cluster's three ranks
# never run beside it (the suite stays under its memory bound, tests/suite_guards.py).
def test_pd_cluster_with_three_tiers_chats_like_unified(
    smollm2: Path,  # noqa: F811
    llm: LLM,
    tmp_path: Path,
) -> None:
    rank_flags = (*FLAGS, "--disaggregation-decode-enable-radix-cache",
                  "--disaggregation-decode-enable-hicache", "--hicache-storage-backend", "file",
                  "--hicache-storage-dir", str(tmp_path / "l3"))  # fmt: skip
    config = LaunchConfig(model=str(smollm2), num_prefill=1, num_decode=2, port=0,
                          log_dir=str(tmp_path / "logs"))  # fmt: skip
    messages: list[dict[str, str]] = []
    cached_tokens = 0
    with (
        launch_cluster(config, rank_flags, {"log_level": "warning"}) as cluster,
        httpx.Client(base_url=cluster.router_url, timeout=300) as http,
    ):
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            body = chat(http, messages)
            answer = body["choices"][0]["message"]["content"]
            assert answer == reference(llm, messages), f"turn {len(messages) // 2 + 1}"
            cached_tokens += body["usage"]["prompt_tokens_details"]["cached_tokens"]
            messages.append({"role": "assistant", "content": answer})
    assert cached_tokens > 0  # later turns reused the earlier turns' KV


def test_chat_uses_the_models_template(http: httpx.Client, llm: LLM) -> None:
    body = chat(http, CAPITAL, model=NAME)
    choice = body["choices"][0]
    assert choice["message"]["content"] == "The capital of France is Paris."
    assert choice["finish_reason"] == "stop"  # at <|im_end|>, the template's end of turn
    # ChatML with the template's default system prompt: exactly the offline prompt ids.
    assert body["usage"]["prompt_tokens"] == len(llm.tokenizer.apply_chat_template(CAPITAL))
    assert http.get("/v1/models").json()["data"][0]["id"] == NAME


def test_stop_string_cuts_real_text(http: httpx.Client) -> None:
    body = chat(http, CAPITAL, stop=[" Paris"])
    assert body["choices"][0]["message"]["content"] == "The capital of France is"
    assert body["choices"][0]["finish_reason"] == "stop"


def test_stream_of_multibyte_text(http: httpx.Client, llm: LLM) -> None:
    """Japanese text whose characters span several byte-level tokens: every streamed delta
    is whole characters, and together they are the non-streamed answer."""
    expected = reference(llm, JAPANESE)
    ids = llm.tokenizer.encode(expected, add_special_tokens=False)
    assert any("\ufffd" in llm.tokenizer.decode([i]) for i in ids), "no split characters"
    body = {"messages": JAPANESE, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": True}
    deltas = []
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for event in sse_events(response):
            if event == "[DONE]":
                break
            for choice in json.loads(event)["choices"]:
                if content := choice["delta"].get("content"):
                    deltas.append(content)
    assert len(deltas) > 1
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == expected == chat(http, JAPANESE)["choices"][0]["message"]["content"]
