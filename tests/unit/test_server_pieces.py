"""The server's pure pieces: ServerConfig and its flags, request limits and max_tokens
defaults, the OpenAI error shape of validation errors, usage sums, and the API-key and
body-size gates (driven in-process through httpx's ASGI transport)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from kvstrata.__main__ import build_parser
from kvstrata.config import ConfigError, ServerConfig, config_from_args
from kvstrata.core import CacheUsage, FinishReason, RequestOutput, SamplingParams
from kvstrata.http.errors import OpenAIError, error_body, validation_message
from kvstrata.http.inputs import RequestLimits
from kvstrata.http.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from kvstrata.http.responses import Usage


def test_serve_flags_come_from_server_config(tmp_path: Any) -> None:
    args = build_parser().parse_args(
        ["serve", "--model", str(tmp_path), "--port", "8001", "--api-key", "k", "--rank", "2"]
    )
    config = config_from_args(ServerConfig, args)
    assert config == ServerConfig(port=8001, api_key="k", rank=2)
    # The body limit is derived from the prompt bounds at start (issue 15: not a fixed 32 MiB).
    assert config.host == "127.0.0.1" and config.max_body_bytes is None


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({"port": 0}, "--port"),
        ({"port": 70000}, "--port"),
        ({"rank": -1}, "--rank"),
        ({"max_body_bytes": 0}, "--max-body-bytes"),
        ({"shutdown_grace_s": -1.0}, "--shutdown-grace-s"),
        ({"api_key": ""}, "--api-key"),
        ({"log_level": "loud"}, "--log-level"),
    ],
)
def test_invalid_server_config_names_the_flag(fields: dict[str, Any], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        ServerConfig(**fields)


def test_max_tokens_defaults_are_capped_and_explicit_values_checked() -> None:
    limits = RequestLimits(vocab_size=100, max_seq_len=64)
    assert limits.max_tokens([10], None, default=16) == 16
    assert limits.max_tokens([60], None, default=16) == 4  # capped to the room left
    assert limits.max_tokens([10, 30], None, default=None) == 34  # all the room, longest prompt
    assert limits.max_tokens([10], 54, default=16) == 54
    with pytest.raises(OpenAIError) as err:
        limits.max_tokens([10], 55, default=16)
    assert (err.value.status_code, err.value.param) == (400, "max_tokens")
    assert err.value.code == "context_length_exceeded"


@pytest.mark.parametrize(
    ("prompt", "code"),
    [([], "empty_prompt"), ([1, 100], "invalid_token_id"), ([-1], "invalid_token_id"),
     ([1] * 64, "context_length_exceeded")],
)  # fmt: skip
def test_bad_prompts_are_refused(prompt: list[int], code: str) -> None:
    with pytest.raises(OpenAIError) as err:
        RequestLimits(vocab_size=100, max_seq_len=64).check_prompt(prompt, "prompt")
    assert (err.value.status_code, err.value.param, err.value.code) == (400, "prompt", code)


def test_validation_errors_name_the_top_level_field() -> None:
    errors = [
        {"type": "greater_than_equal", "loc": ("body", "max_tokens"), "msg": "must be >= 1"},
        {"type": "string_type", "loc": ("body", "messages", 0, "content"), "msg": "not a str"},
    ]
    message, param = validation_message(errors)
    assert param == "max_tokens"
    assert "max_tokens: must be >= 1" in message and "messages.0.content: not a str" in message
    assert validation_message([{"type": "json_invalid", "loc": ("body", 5), "msg": "x"}]) == (
        "the request body is not valid JSON",
        None,
    )
    assert error_body(404, "gone", "model", "model_not_found") == {
        "error": {"message": "gone", "type": "not_found_error", "param": "model",
                  "code": "model_not_found"}
    }  # fmt: skip


def test_usage_sums_requests_and_splits_cached_tokens_by_tier() -> None:
    def out(prompt_len: int, output_len: int, usage: CacheUsage) -> RequestOutput:
        return RequestOutput(
            rid="r", prompt_ids=[1] * prompt_len, output_ids=[2] * output_len, new_token_ids=[],
            text="", finished=True, finish_reason=FinishReason.STOP, cache_usage=usage,
        )  # fmt: skip

    usage = Usage.of(
        [out(40, 5, CacheUsage(l1_tokens=16)), out(20, 3, CacheUsage(l1_tokens=8, l2_tokens=4))],
        rank=3,
    )
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (60, 8, 68)
    assert usage.prompt_tokens_details.cached_tokens == 28
    assert usage.kvstrata.model_dump() == {
        "cached_tokens_l1": 24, "cached_tokens_l2": 4, "cached_tokens_l3": 0,
        "transferred_tokens": 0, "local_prefill_tokens": 0, "rank": 3,
    }  # fmt: skip


def test_tiny_temperatures_sample_greedily() -> None:
    assert SamplingParams(temperature=1e-300).is_greedy
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy


async def _echo_app(scope: Scope, receive: Receive, send: Send) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"%d" % len(body)})


def _call(app: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def test_api_key_gate() -> None:
    app = ApiKeyMiddleware(_echo_app, api_key="k")
    assert _call(app, "GET", "/health").status_code == 200
    refused = _call(app, "GET", "/v1/models", headers={"authorization": "Bearer nope"})
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert _call(app, "GET", "/v1/models").status_code == 401
    assert _call(app, "GET", "/v1/models", headers={"authorization": "Bearer k"}).text == "0"


def test_body_limit_gate_counts_declared_and_streamed_bodies() -> None:
    app = BodyLimitMiddleware(_echo_app, max_body_bytes=10)
    assert _call(app, "POST", "/x", content=b"0123456789").text == "10"
    too_big = _call(app, "POST", "/x", content=b"0123456789A")
    assert too_big.status_code == 413
    assert too_big.json()["error"]["code"] == "request_too_large"

    async def chunks() -> Any:  # no Content-Length: counted as it arrives
        for _ in range(4):
            yield b"xxxx"

    assert _call(app, "POST", "/x", content=chunks()).status_code == 413
