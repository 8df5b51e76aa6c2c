"""Reasoning split from the answer (http/reasoning.py, server/chat_output.py): whole and
streamed give the same parts however the text is cut, whether the model or the prompt
opened the think block; tool calls are parsed from the answer only."""

from __future__ import annotations

import pytest

from kvstrata.http.reasoning import (
    ReasoningFormat,
    prompt_opens_thinking,
    reasoning_format,
    split_reasoning,
)
from kvstrata.http.tool_parser import ToolFormat
from kvstrata.server.chat_output import ChatOutput

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
CASES = [
    # (text, opened by the prompt, reasoning, content)
    ("<think>\nplan it\n</think>\n\nThe answer.", False, "plan it", "The answer."),
    ("plan it</think>Done", True, "plan it", "Done"),
    ("<think>cut before the end", False, "cut before the end", ""),
    ("still thinking", True, "still thinking", ""),
    ("No thinking at all.", False, None, "No thinking at all."),
    ("  <thin>not a tag</thin>", False, None, "  <thin>not a tag</thin>"),
    (f"<think>call f</think>{CALL}", False, "call f", ""),
]


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), CASES)
def test_whole_split(text: str, opened: bool, reasoning: str | None, content: str) -> None:
    if CALL in text:
        part = ChatOutput(ToolFormat.HERMES, opened).whole(text)
        assert (part.reasoning, part.content, [c.name for c in part.calls]) == (
            reasoning,
            None,
            ["f"],
        )
        return
    split = split_reasoning(text, opened)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), CASES)
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_streamed_like_whole(
    text: str, opened: bool, reasoning: str | None, content: str, step: int
) -> None:
    output = ChatOutput(ToolFormat.HERMES, opened)
    got_reasoning, got_content, calls = "", "", []
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for k, piece_text in enumerate(pieces):
        piece = output.piece(0, piece_text, last=k == len(pieces) - 1)
        got_reasoning += piece.reasoning
        got_content += piece.content
        calls += piece.calls
    whole = output.whole(text)
    assert (got_reasoning.strip() or None) == whole.reasoning
    assert got_content.strip() == (whole.content or "").strip()
    assert [c.arguments for c in calls] == [c.arguments for c in whole.calls]


def test_which_parser_and_whether_the_prompt_opened_the_block() -> None:
    assert reasoning_format("auto", "{{ '<think>' }}") is ReasoningFormat.QWEN3
    assert reasoning_format("auto", "no thinking here") is None
    assert reasoning_format("none", "<think>") is None
    assert reasoning_format("qwen3", None) is ReasoningFormat.QWEN3
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
