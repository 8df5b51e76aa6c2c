"""Tool calls in a model's output text, by format: `hermes` (`<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` blocks; Qwen, Hermes, and kvstrata's own tool prompt) and
`llama3_json` (the output is `{"name": ..., "parameters": {...}}`, after an optional
`<|python_tag|>`). `parse_tool_calls` splits a whole output into content and calls;
`ToolCallStream` does it as the text arrives, holding back only what may start a call."""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


class ToolFormat(str, enum.Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.S)


@dataclass(frozen=True)
class ParsedCall:
    """One call: its function's name and its arguments as JSON text (re-serialized, so it
    is strict JSON whatever whitespace the model wrote)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when the output was calls only
    calls: list[ParsedCall]


def call_json(name: str, arguments: Any) -> str:
    """A call as the hermes format writes it between its tags (and as the grammar makes the
    model write it: one space after ',' and ':'), so history renders as it was generated."""
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def parse_tool_calls(text: str, fmt: ToolFormat) -> ParsedOutput:
    """The calls in a whole output; text that is not a well-formed call stays content (a
    malformed block is content too, as the model wrote it)."""
    if fmt is ToolFormat.LLAMA3_JSON:
        return _parse_llama3(text)
    calls: list[ParsedCall] = []
    pieces: list[str] = []
    end = 0
    for block in _HERMES_BLOCK.finditer(text):
        call = _call_of(block.group(1), "arguments")
        if call is None:
            continue  # not a call: left in the content below
        pieces.append(text[end : block.start()])
        calls.append(call)
        end = block.end()
    pieces.append(text[end:])
    content = "".join(pieces).strip()
    if not calls:
        return ParsedOutput(text, [])
    return ParsedOutput(content or None, calls)


def _parse_llama3(text: str) -> ParsedOutput:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    calls = [_call_of(part, "parameters") for part in body.split(";")] if body else []
    if not calls or any(call is None for call in calls):
        return ParsedOutput(text, [])
    return ParsedOutput(None, [call for call in calls if call is not None])


def _call_of(body: str, arguments_key: str) -> ParsedCall | None:
    try:
        value = json.loads(body, strict=False)  # a raw control character is still JSON text
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments, strict=False)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


@dataclass
class StreamPiece:
    """What one stretch of streamed text adds: content to send, and calls completed."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


class ToolCallStream:
    """One choice's streamed output, split as it arrives. Content goes out at once but for
    a tail that may be the start of a call's opening tag; a call goes out whole once its
    closing tag arrived (with its arguments in one piece)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._held = ""  # text not sent yet: a possible tag start, or a call in progress
        self._decided = fmt is ToolFormat.HERMES  # llama3_json: is the output a call?
        self._whole_output = False  # llama3_json: the output is a call, parsed at the end
        self.num_calls = 0

    def feed(self, text: str) -> StreamPiece:
        self._held += text
        if not self._decided:
            stripped = self._held.lstrip()
            if not stripped:
                return StreamPiece()
            self._decided = True
            self._whole_output = stripped.startswith(("{", PYTHON_TAG[: len(stripped)]))
        if self._whole_output:
            return StreamPiece()
        return self._hermes_piece()

    def finish(self) -> StreamPiece:
        """The end of the output: what was held goes out (a call, or the text it was)."""
        held, self._held = self._held, ""
        if self._whole_output or (self.fmt is ToolFormat.LLAMA3_JSON and not self._decided):
            parsed = parse_tool_calls(held, self.fmt)
            self.num_calls += len(parsed.calls)
            return StreamPiece(parsed.content or "", parsed.calls)
        return StreamPiece(held)

    def _hermes_piece(self) -> StreamPiece:
        piece = StreamPiece()
        while True:
            start = self._held.find(HERMES_OPEN)
            if start < 0:
                keep = _partial_tag_len(self._held, HERMES_OPEN)
                cut = len(self._held) - keep
                piece.content += self._held[:cut]
                self._held = self._held[cut:]
                return piece
            close = self._held.find(HERMES_CLOSE, start)
            if close < 0:
                piece.content += self._held[:start]
                self._held = self._held[start:]
                return piece
            block_end = close + len(HERMES_CLOSE)
            call = _call_of(self._held[start + len(HERMES_OPEN) : close], "arguments")
            if call is None:
                piece.content += self._held[:block_end]
            else:
                piece.content += self._held[:start]
                piece.calls.append(call)
                self.num_calls += 1
            self._held = self._held[block_end:]


def _partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (to hold back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
