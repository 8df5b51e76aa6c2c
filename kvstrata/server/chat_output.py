"""How a chat answer's text splits into reasoning (`--reasoning-parser`), content and tool
calls (when the request offered tools): `ChatOutput` for a whole choice, and one stream
per choice that does the same as the text arrives (reasoning first, then the answer's
calls parsed from the content)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.http.reasoning import ReasoningStream, split_reasoning
from kvstrata.http.tool_parser import ParsedCall, ToolCallStream, ToolFormat, parse_tool_calls


@dataclass(frozen=True)
class ChatPart:
    reasoning: str | None
    content: str | None
    calls: list[ParsedCall]


@dataclass
class ChatPiece:
    reasoning: str = ""
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    first_call_index: int = 0  # the choice's index of calls[0]


class ChatOutput:
    """`tools`: the format calls are parsed in (None: none offered). `thinking`: None, no
    reasoning parser; else whether the prompt opened the think block."""

    def __init__(self, tools: ToolFormat | None, thinking: bool | None) -> None:
        self.tools = tools
        self.thinking = thinking
        self._streams: dict[int, _ChoiceStream] = {}

    @property
    def is_plain(self) -> bool:
        return self.tools is None and self.thinking is None

    def whole(self, text: str) -> ChatPart:
        reasoning, content = None, text
        if self.thinking is not None:
            split = split_reasoning(text, self.thinking)
            reasoning, content = split.reasoning, split.content
        if self.tools is None:
            return ChatPart(reasoning, content, [])
        parsed = parse_tool_calls(content, self.tools)
        return ChatPart(reasoning, parsed.content if parsed.calls else content, parsed.calls)

    def piece(self, index: int, text: str, last: bool) -> ChatPiece:
        """What choice `index`'s new `text` adds; `last`: its output ended."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = _ChoiceStream(self.tools, self.thinking)
        return stream.piece(text, last)

    def num_calls(self, index: int) -> int:
        stream = self._streams.get(index)
        return stream.tools.num_calls if stream is not None and stream.tools else 0


class _ChoiceStream:
    def __init__(self, tools: ToolFormat | None, thinking: bool | None) -> None:
        self.reasoning = ReasoningStream(thinking) if thinking is not None else None
        self.tools = ToolCallStream(tools) if tools is not None else None

    def piece(self, text: str, last: bool) -> ChatPiece:
        out = ChatPiece()
        content = text
        if self.reasoning is not None:
            split = self.reasoning.feed(text)
            if last:
                end = self.reasoning.finish()
                split.reasoning += end.reasoning
                split.content += end.content
            out.reasoning, content = split.reasoning, split.content
        if self.tools is None:
            out.content = content
            return out
        out.first_call_index = self.tools.num_calls
        tool_piece = self.tools.feed(content)
        out.content, out.calls = tool_piece.content, list(tool_piece.calls)
        if last:
            end_piece = self.tools.finish()
            out.content += end_piece.content
            out.calls += end_piece.calls
        return out
