"""A reasoning model's thinking, split from its answer (`--reasoning-parser`): `qwen3`
thinks inside `<think>...</think>` before answering; the block is opened by the model, or
by the chat template at the end of the prompt (then the output starts thinking).
`split_reasoning` splits a whole output, `ReasoningStream` does it as the text arrives;
tool calls are parsed from the answer part only."""

from __future__ import annotations

import enum
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningFormat(str, enum.Enum):
    QWEN3 = "qwen3"


def reasoning_format(flag: str, template: str | None) -> ReasoningFormat | None:
    """`--reasoning-parser`: none, qwen3, or auto (qwen3 when the template writes
    `<think>`)."""
    if flag == "none":
        return None
    if flag == "auto":
        return ReasoningFormat.QWEN3 if template is not None and THINK_OPEN in template else None
    return ReasoningFormat(flag)


def prompt_opens_thinking(prompt_text: str) -> bool:
    """The template ended the prompt inside an open `<think>` block."""
    tail = prompt_text[prompt_text.rfind(THINK_OPEN) :] if THINK_OPEN in prompt_text else ""
    return bool(tail) and THINK_CLOSE not in tail


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: the output did not think
    content: str


def split_reasoning(text: str, opened: bool) -> Split:
    """`opened`: the prompt opened the block. Thinking runs to the first `</think>`, or to
    the end of an output cut before it."""
    stripped = text.lstrip()
    if not opened and not stripped.startswith(THINK_OPEN):
        return Split(None, text)
    body = stripped.removeprefix(THINK_OPEN) if not opened else text
    close = body.find(THINK_CLOSE)
    if close < 0:
        return Split(body.strip(), "")
    return Split(body[:close].strip(), body[close + len(THINK_CLOSE) :].lstrip())


@dataclass
class StreamedSplit:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """One choice's stream, split as `split_reasoning` splits the whole: held back only a
    tail that may begin the tag that would change where the text goes."""

    def __init__(self, opened: bool) -> None:
        self._held = ""
        # None: not known yet whether the output thinks (it may start "<think>").
        self._thinking: bool | None = True if opened else None
        self._after_close = False  # the answer's leading whitespace is dropped

    def feed(self, text: str) -> StreamedSplit:
        self._held += text
        out = StreamedSplit()
        if self._thinking is None:
            stripped = self._held.lstrip()
            if not stripped or (
                len(stripped) < len(THINK_OPEN) and THINK_OPEN.startswith(stripped)
            ):
                return out
            self._thinking = stripped.startswith(THINK_OPEN)
            if self._thinking:
                self._held = stripped[len(THINK_OPEN) :].lstrip()
        if not self._thinking:
            out.content, self._held = self._answer(self._held), ""
            return out
        close = self._held.find(THINK_CLOSE)
        if close >= 0:
            out.reasoning = self._held[:close]
            self._thinking, self._after_close = False, True
            out.content = self._answer(self._held[close + len(THINK_CLOSE) :])
            self._held = ""
            return out
        keep = _partial_len(self._held, THINK_CLOSE)
        cut = len(self._held) - keep
        out.reasoning, self._held = self._held[:cut], self._held[cut:]
        return out

    def finish(self) -> StreamedSplit:
        held, self._held = self._held, ""
        if self._thinking:
            return StreamedSplit(reasoning=held)
        return StreamedSplit(content=self._answer(held))

    def _answer(self, text: str) -> str:
        if self._after_close:
            text = text.lstrip()
            self._after_close = not text
        return text


def _partial_len(text: str, tag: str) -> int:
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
