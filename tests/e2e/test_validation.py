"""Bad input to a live server: every case gets its 4xx with the OpenAI error shape, and
none of them reaches the engine. A client that disconnects mid-stream aborts its request
and its pages come back."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest
from server_harness import (
    MAX_BODY_BYTES,
    MAX_MODEL_LEN,
    MODEL_NAME,
    assert_idle,
    sse_events,
    wait_until,
    wait_until_idle,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
MESSAGES = [{"role": "user", "content": "Hello"}]
TOP = "top_logprobs"  # needs logprobs: true
OUT_OF_VOCAB = 1_000_000


def case(name: str, path: str, body: Any, status: int, param: str | None) -> Any:
    """One bad request: JSON body (or raw bytes), expected status and `param`."""
    return pytest.param(path, body, status, param, id=name)


CASES = [
    case("malformed json", COMPLETIONS, b'{"prompt": "x",', 400, None),
    case("body not an object", COMPLETIONS, [1, 2], 400, None),
    case("missing prompt", COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
    case(
        "max_tokens as string", COMPLETIONS, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"
    ),
    case(
        "temperature as string",
        CHAT,
        {"messages": MESSAGES, "temperature": "hot"},
        400,
        "temperature",
    ),
    case("messages as string", CHAT, {"messages": "hello"}, 400, "messages"),
    case("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    case(
        "image content",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages",
    ),
    case("unknown model", COMPLETIONS, {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    case("unknown chat model", CHAT, {"model": "gpt-9", "messages": MESSAGES}, 404, "model"),
    case("max_tokens 0", COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    case("max_tokens negative", CHAT, {"messages": MESSAGES, "max_tokens": -1}, 400, "max_tokens"),
    case(
        "max_new_tokens 0",
        GENERATE,
        {"text": "x", "sampling_params": {"max_new_tokens": 0}},
        400,
        "sampling_params",
    ),
    case(
        "temperature negative",
        COMPLETIONS,
        {"prompt": "x", "temperature": -0.5},
        400,
        "temperature",
    ),
    case("top_p zero", COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    case("top_p above one", CHAT, {"messages": MESSAGES, "top_p": 1.5}, 400, "top_p"),
    case(
        "max_tokens past context",
        COMPLETIONS,
        {"prompt": "x", "max_tokens": MAX_MODEL_LEN},
        400,
        "max_tokens",
    ),
    case("prompt past context", COMPLETIONS, {"prompt": [5] * (MAX_MODEL_LEN + 1)}, 400, "prompt"),
    case("generate past context", GENERATE, {"input_ids": [5] * MAX_MODEL_LEN}, 400, "input_ids"),
    case("token id out of vocab", COMPLETIONS, {"prompt": [1, OUT_OF_VOCAB]}, 400, "prompt"),
    case("negative token id", COMPLETIONS, {"prompt": [1, -3]}, 400, "prompt"),
    case("generate id out of vocab", GENERATE, {"input_ids": [OUT_OF_VOCAB]}, 400, "input_ids"),
    case("empty prompt string", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    case("empty prompt list", COMPLETIONS, {"prompt": []}, 400, "prompt"),
    case("empty generate text", GENERATE, {"text": ""}, 400, "text"),
    case("no messages", CHAT, {"messages": []}, 400, "messages"),
    case("text and input_ids", GENERATE, {"text": "x", "input_ids": [1]}, 400, "text"),
    case("empty stop string", COMPLETIONS, {"prompt": "x", "stop": [""]}, 400, "stop"),
    case("n above the bound", COMPLETIONS, {"prompt": "x", "n": 129}, 400, "n"),
    case("top_logprobs alone", CHAT, {"messages": MESSAGES, "top_logprobs": 1}, 400, TOP),
    case("body too large", COMPLETIONS, {"prompt": "x" * (MAX_BODY_BYTES + 1)}, 413, None),
    case("priority above 99", COMPLETIONS, {"prompt": "x", "priority": 100}, 400, "priority"),
    case("priority negative", CHAT, {"messages": MESSAGES, "priority": -1}, 400, "priority"),
    case(
        "retention_seconds zero",
        COMPLETIONS,
        {"prompt": "x", "retention_seconds": 0},
        400,
        "retention_seconds",
    ),
    case(
        "generate priority as string",
        GENERATE,
        {"text": "x", "sampling_params": {"priority": "5"}},
        400,
        "sampling_params",
    ),
]


def check_error_shape(resp: httpx.Response, status: int, param: str | None) -> None:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] == param
    assert "Traceback" not in resp.text


def requests_started(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvstrata_requests_total{")
    )


@pytest.mark.parametrize(("path", "body", "status", "param"), CASES)
def test_invalid_input_gets_openai_error(
    http: httpx.Client, path: str, body: Any, status: int, param: str | None
) -> None:
    before = requests_started(http)
    if isinstance(body, bytes):
        resp = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        resp = http.post(path, json=body)
    check_error_shape(resp, status, param)
    assert requests_started(http) == before  # nothing reached the engine
    assert_idle(http)


def test_unknown_route_and_method_get_openai_errors(http: httpx.Client) -> None:
    check_error_shape(http.get("/v1/nothing"), 404, None)
    check_error_shape(http.get(COMPLETIONS), 405, None)


def test_streamed_body_over_limit_is_refused(http: httpx.Client) -> None:
    def chunks() -> Any:  # no Content-Length: the server must count as it reads
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 10_000 + 1):
            yield b"x" * 10_000
        yield b'"}'

    resp = http.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
    check_error_shape(resp, 413, None)


def test_disconnect_mid_stream_aborts_and_frees_pages(http: httpx.Client) -> None:
    aborted_before = _aborted(http)
    body = {
        "model": MODEL_NAME, "prompt": "The light swept over the waves", "stream": True,
        "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True, "temperature": 0,
    }  # fmt: skip
    with http.stream("POST", COMPLETIONS, json=body) as resp:
        events = sse_events(resp)
        first = json.loads(next(events))
        assert first["choices"][0]["finish_reason"] is None
    # Leaving the block closed the connection after one event of a long generation.
    wait_until_idle(http)
    assert_idle(http)
    assert _aborted(http) == aborted_before + 1


def test_disconnect_while_waiting_non_streaming_aborts(server: Any, http: httpx.Client) -> None:
    aborted_before = _aborted(http)
    body = json.dumps(
        {"prompt": "Rain falls softly", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True}
    ).encode()
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    url = httpx.URL(server.base_url)
    with socket.create_connection((url.host, url.port)) as sock:
        sock.sendall(head + body)
        wait_until(http, lambda load: load["num_running_reqs"] == 1)
    wait_until_idle(http)
    assert_idle(http)
    assert _aborted(http) == aborted_before + 1


def _aborted(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith('kvstrata_requests_total{finish_reason="abort"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
