"""No silently ignored parameters on a live rank: every OpenAI (or vLLM extension) field
the engine does not implement is a 400 naming it (`param`, code unsupported_parameter)
unless its value means "off"; unknown fields are a 400 naming them (vLLM's strict mode),
on the OpenAI and the native endpoints alike; out-of-range values of the implemented
sampling fields are a 400 naming them. Nothing refused reaches the engine."""

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
    (COMPLETIONS, "best_of", 1, 2),  # best_of = n is plain n; more (pick the best) is not
    (COMPLETIONS, "suffix", "", " the end"),
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
        (GENERATE, GENERATE_BODY | {"sampling_params": {"min_tokens": 1}},
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


def test_wrong_type_of_a_parameter_names_it(http: httpx.Client) -> None:
    assert_refused(http, CHAT, CHAT_BODY | {"presence_penalty": "none"}, "presence_penalty")
    assert_refused(http, COMPLETIONS, COMPLETION_BODY | {"best_of": 0}, "best_of")


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        (CHAT, {"presence_penalty": 2.5}, "presence_penalty"),
        (COMPLETIONS, {"frequency_penalty": -3}, "frequency_penalty"),
        (CHAT, {"repetition_penalty": 0}, "repetition_penalty"),
        (CHAT, {"logit_bias": {"5": 101}}, "logit_bias"),
        (CHAT, {"logit_bias": {"x": 1}}, "logit_bias"),
        (COMPLETIONS, {"logit_bias": {"99999999": 1}}, "logit_bias"),
        (CHAT, {"min_tokens": 3}, "min_tokens"),  # more than max_tokens (2)
        (CHAT, {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (COMPLETIONS, {"logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"n": 0}, "n"),
        (CHAT, {"n": 129}, "n"),
        (COMPLETIONS, {"stop_token_ids": [10**6]}, "stop_token_ids"),
        (GENERATE, {"sampling_params": {"min_new_tokens": 3, "max_new_tokens": 2}},
         "min_new_tokens"),
        (GENERATE, {"top_logprobs_num": 30}, "top_logprobs_num"),
    ],
)  # fmt: skip
def test_an_out_of_range_sampling_value_is_refused_naming_it(
    http: httpx.Client, path: str, extra: dict[str, Any], param: str
) -> None:
    assert_refused(http, path, body_of(path) | extra, param)
