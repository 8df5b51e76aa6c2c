"""No silently ignored parameters on a live rank: every OpenAI (or vLLM extension) field
the engine does not implement yet is a 400 naming it (`param`, code unsupported_parameter)
unless its value means "off"; unknown fields are a 400 naming them (vLLM's strict mode),
on the OpenAI and the native endpoints alike. Nothing refused reaches the engine."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from server_harness import assert_idle

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
CHAT_BODY = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
COMPLETION_BODY = {"prompt": "Hello", "max_tokens": 2}
GENERATE_BODY = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}
BOTH = (CHAT, COMPLETIONS)

# (field, a value that means off, a value that does something) per endpoint.
UNSUPPORTED: list[tuple[str, str, Any, Any]] = [
    *[(path, "presence_penalty", 0, 0.5) for path in BOTH],
    *[(path, "frequency_penalty", 0.0, -1.0) for path in BOTH],
    *[(path, "repetition_penalty", 1.0, 1.2) for path in BOTH],
    *[(path, "logit_bias", {}, {"5": 10.0}) for path in BOTH],
    *[(path, "logit_bias", None, {"5": -100.0}) for path in BOTH],
    *[(path, "min_tokens", 0, 2) for path in BOTH],
    (CHAT, "response_format", {"type": "text"}, {"type": "json_object"}),
    (CHAT, "tools", [], [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    (CHAT, "tool_choice", "none", "auto"),
    (CHAT, "logprobs", False, True),
    (COMPLETIONS, "best_of", 1, 2),
    (COMPLETIONS, "suffix", "", " the end"),
    (COMPLETIONS, "echo", False, True),
    (COMPLETIONS, "logprobs", None, 1),
]


def body_of(path: str) -> dict[str, Any]:
    return {CHAT: CHAT_BODY, COMPLETIONS: COMPLETION_BODY, GENERATE: GENERATE_BODY}[path]


def requests_started(http: httpx.Client) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in http.get("/metrics").text.splitlines()
        if line.startswith("kvstrata_requests_total{")
    )


def assert_refused(http: httpx.Client, path: str, body: dict[str, Any], param: str) -> dict:
    before = requests_started(http)
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert param in error["message"]
    assert requests_started(http) == before  # refused at the door
    assert_idle(http)
    return error


@pytest.mark.parametrize(("path", "field", "off", "on"), UNSUPPORTED)
def test_an_unimplemented_parameter_is_refused_unless_off(
    http: httpx.Client, path: str, field: str, off: Any, on: Any
) -> None:
    error = assert_refused(http, path, body_of(path) | {field: on}, field)
    assert error["code"] == "unsupported_parameter"
    accepted = http.post(path, json=body_of(path) | {field: off})
    assert accepted.status_code == 200, accepted.text


def test_every_off_value_together_is_accepted(http: httpx.Client) -> None:
    for path in BOTH:
        offs = {field: off for p, field, off, _ in UNSUPPORTED if p == path}
        response = http.post(path, json=body_of(path) | offs)
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, GENERATE])
def test_an_unknown_field_is_refused_naming_it(http: httpx.Client, path: str) -> None:
    assert_refused(http, path, body_of(path) | {"temprature": 0.5}, "temprature")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (GENERATE, GENERATE_BODY | {"sampling_params": {"frequency_penalty": 0.5}},
         "sampling_params"),
        (CHAT, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
        (CHAT, CHAT_BODY | {"stream": True, "stream_options": {"include_usage": True,
                                                              "continuous": True}},
         "stream_options"),
        (CHAT, CHAT_BODY | {"response_format": {"type": "text", "strict": True}},
         "response_format"),
    ],
)  # fmt: skip
def test_an_unknown_nested_field_is_refused_naming_its_field(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    assert_refused(http, path, body, param)


def test_wrong_type_of_an_unimplemented_parameter_names_it(http: httpx.Client) -> None:
    assert_refused(http, CHAT, CHAT_BODY | {"presence_penalty": "none"}, "presence_penalty")
    assert_refused(http, COMPLETIONS, COMPLETION_BODY | {"best_of": 0}, "best_of")
