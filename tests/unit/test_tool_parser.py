"""Tool calls parsed out of model text (http/tool_parser.py), whole and streamed: the same
calls and content however the text is cut into deltas; malformed blocks stay content."""

from __future__ import annotations

import json

import pytest

from kvstrata.http.tool_parser import (
    ToolCallStream,
    ToolFormat,
    call_json,
    parse_tool_calls,
)

HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 9}}\n</tool_call>'
)


def calls_of(text: str, fmt: ToolFormat) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parse_tool_calls(text, fmt).calls]


def test_hermes_blocks_become_calls_and_the_rest_content() -> None:
    parsed = parse_tool_calls(HERMES, ToolFormat.HERMES)
    assert parsed.content == "Let me check."
    assert calls_of(HERMES, ToolFormat.HERMES) == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": 9}),
    ]
    assert len({c.id for c in parsed.calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        "no calls here",
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # not an object
        '<tool_call>\n{"name": "f", "arguments": {}}',  # never closed
    ],
)
def test_what_is_not_a_call_stays_content(text: str) -> None:
    assert parse_tool_calls(text, ToolFormat.HERMES).calls == []
    assert parse_tool_calls(text, ToolFormat.HERMES).content == text


def test_arguments_are_strict_json_whatever_the_model_wrote() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"x\\ty\\"}"}</tool_call>'
    (call,) = parse_tool_calls(text, ToolFormat.HERMES).calls
    assert json.loads(call.arguments) == {"a": "x\ty"}  # parses with json's strict default


def test_llama3_json_is_a_bare_object() -> None:
    text = '<|python_tag|>{"name": "get_time", "parameters": {"zone": -3}}'
    assert calls_of(text, ToolFormat.LLAMA3_JSON) == [("get_time", {"zone": -3})]
    two = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'
    assert calls_of(two, ToolFormat.LLAMA3_JSON) == [("a", {}), ("b", {"x": 1})]
    assert parse_tool_calls("Paris is sunny.", ToolFormat.LLAMA3_JSON).calls == []


@pytest.mark.parametrize("fmt", list(ToolFormat))
@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_as_whole(fmt: ToolFormat, step: int) -> None:
    texts = {
        ToolFormat.HERMES: [HERMES, "plain <tool text", "a <tool_call>{bad}</tool_call> b"],
        ToolFormat.LLAMA3_JSON: ['  {"name": "x", "parameters": {"k": [1, 2]}}', "Hello."],
    }[fmt]
    for text in texts:
        stream = ToolCallStream(fmt)
        content, calls = "", []
        for start in range(0, len(text), step):
            piece = stream.feed(text[start : start + step])
            content, calls = content + piece.content, calls + piece.calls
        end = stream.finish()
        content, calls = content + end.content, calls + end.calls
        whole = parse_tool_calls(text, fmt)
        assert [(c.name, c.arguments) for c in calls] == [
            (c.name, c.arguments) for c in whole.calls
        ]
        if whole.calls:
            assert content.strip() == (whole.content or "")
        else:
            assert content == text


def test_a_call_renders_as_the_grammar_makes_the_model_write_it() -> None:
    assert call_json("f", {"a": 1, "b": "é"}) == '{"name": "f", "arguments": {"a": 1, "b": "é"}}'
