"""Tool calling on a live rank through the official `openai` client: `tool_choice`
"required" and a named function are enforced by a grammar (the answer is always a
parseable call whose arguments are valid against the tool's schema), streamed as
OpenAI-shaped `tool_calls` deltas, with one call when `parallel_tool_calls` is false;
history with assistant calls and tool results renders; bad tool requests are 400s."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from server_harness import ServerProcess, assert_idle, start_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMED = ("--served-model-name", "tiny")
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


@pytest.fixture()
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def check_calls(calls: list, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_tool_choice_always_calls_a_tool(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    for seed in range(4):
        answer = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",  # type: ignore[arg-type]
            max_tokens=300,
            temperature=1.0,
            seed=seed,
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        check_calls(choice.message.tool_calls or [], set(SCHEMAS))
    assert_idle(http)


def test_a_named_function_is_called_once(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        max_tokens=200,
        temperature=0.7,
        seed=3,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    calls = answer.choices[0].message.tool_calls or []
    assert len(calls) == 1
    check_calls(calls, {"get_time"})


def test_no_parallel_calls_means_one_call(client: openai.OpenAI) -> None:
    for seed in range(3):
        answer = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",  # type: ignore[arg-type]
            parallel_tool_calls=False,
            max_tokens=300,
            temperature=1.0,
            seed=seed,
        )
        assert len(answer.choices[0].message.tool_calls or []) == 1


def test_streamed_tool_calls_arrive_as_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",  # type: ignore[arg-type]
        max_tokens=300,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": delta.id, "name": "", "args": ""})
                entry["name"] += delta.function.name or ""  # type: ignore[union-attr]
                entry["args"] += delta.function.arguments or ""  # type: ignore[union-attr]
    assert calls and reasons[-1] == "tool_calls"
    whole = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",  # type: ignore[arg-type]
        max_tokens=300,
        temperature=0,
    )
    got = [(c["name"], json.loads(c["args"])) for _, c in sorted(calls.items())]
    want = whole.choices[0].message.tool_calls or []
    assert got == [(c.function.name, json.loads(c.function.arguments)) for c in want]


def test_history_with_calls_and_results_renders(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",  # type: ignore[arg-type]
        parallel_tool_calls=False,
        max_tokens=300,
        temperature=0,
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"result": 21}'},
    ]
    after = client.chat.completions.create(
        model="tiny",
        messages=history,
        tools=TOOLS,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The second turn's prompt holds the first turn's prompt and its call as generated.
    assert after.usage is not None and after.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_bad_tool_requests_are_refused_naming_the_field(
    http: httpx.Client, extra: dict, param: str
) -> None:
    body = {"model": "tiny", "messages": ASK, "max_tokens": 5} | extra
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert_idle(http)


def test_reasoning_goes_to_reasoning_content(tiny_llama: Path, tmp_path: Path) -> None:
    """--reasoning-parser qwen3: the <think> block goes to message.reasoning_content (and
    streamed deltas' reasoning_content), the rest is the answer; chat_template_kwargs
    reach the template, but may not replace what the server sets."""
    rank = start_server(tiny_llama, tmp_path, "--reasoning-parser", "qwen3", *NAMED)
    thought = {"regex": "<think>[a-z]{2,8}( [a-z]{2,8}){0,2}</think>[A-Z][a-z]{1,8}"}
    try:
        client = openai.OpenAI(base_url=rank.base_url + "/v1", api_key="x", max_retries=0)
        whole = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=60,
            temperature=0,
            extra_body=thought,
        )
        message = whole.choices[0].message
        reasoning = message.reasoning_content  # type: ignore[attr-defined]
        assert re.fullmatch("[a-z]{2,8}( [a-z]{2,8}){0,2}", reasoning)
        assert re.fullmatch("[A-Z][a-z]{1,8}", message.content or "")
        streamed = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=60,
            temperature=0,
            stream=True,
            extra_body=thought | {"chat_template_kwargs": {"enable_thinking": True}},
        )
        parts = {"reasoning": "", "content": ""}
        for chunk in streamed:
            for choice in chunk.choices:
                parts["reasoning"] += getattr(choice.delta, "reasoning_content", None) or ""
                parts["content"] += choice.delta.content or ""
        assert (parts["reasoning"], parts["content"]) == (reasoning, message.content)
        with httpx.Client(base_url=rank.base_url, timeout=60) as http:
            body = {"messages": ASK, "max_tokens": 2, "chat_template_kwargs": {"messages": []}}
            refused = http.post("/v1/chat/completions", json=body)
            assert refused.status_code == 400
            assert refused.json()["error"]["param"] == "chat_template_kwargs"
    finally:
        assert rank.stop() == 0, rank.log()
