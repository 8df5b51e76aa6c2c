"""The cache usage a rank reports back (`usage.kvstrata` of a JSON answer, or of the last
SSE event that carries one), read by the router to compare its estimates with real hits,
from answers it relays chunk by chunk (it never holds a whole answer)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CachedTokens:
    """A request's prompt tokens and how many of them each tier served."""

    prompt_tokens: int
    l1_tokens: int
    l2_tokens: int
    l3_tokens: int

    @property
    def cached_tokens(self) -> int:
        return self.l1_tokens + self.l2_tokens + self.l3_tokens


def usage_of(body: Any) -> CachedTokens | None:
    """From a parsed answer (or SSE event) body; None if it carries no kvstrata usage."""
    if not isinstance(body, dict):
        return None
    usage = body.get("usage")
    if not isinstance(usage, dict) or not isinstance(usage.get("kvstrata"), dict):
        return None
    tiers = usage["kvstrata"]
    try:
        return CachedTokens(
            int(usage.get("prompt_tokens", 0)),
            int(tiers.get("cached_tokens_l1", 0)),
            int(tiers.get("cached_tokens_l2", 0)),
            int(tiers.get("cached_tokens_l3", 0)),
        )
    except (TypeError, ValueError):
        return None


def usage_of_json(content: bytes) -> CachedTokens | None:
    try:
        return usage_of(json.loads(content))
    except ValueError:
        return None


class SseUsage:
    """Fed an SSE body chunk by chunk (events may straddle chunks); keeps the last usage
    seen and the code of the last error event. Only `data:` lines that mention kvstrata
    or an error are parsed (text in an event is JSON-escaped: its quotes cannot match)."""

    def __init__(self) -> None:
        self.usage: CachedTokens | None = None
        self.error_code: str | None = None
        self._partial = b""

    def feed(self, chunk: bytes) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if not line.startswith(b"data: "):
                continue
            if b'"kvstrata"' in line:
                usage = usage_of_json(line[len(b"data: ") :])
                if usage is not None:
                    self.usage = usage
            if b'"error"' in line:
                self._read_error(line[len(b"data: ") :])

    def _read_error(self, data: bytes) -> None:
        try:
            event = json.loads(data)
        except ValueError:
            return
        error = event.get("error") if isinstance(event, dict) else None
        if isinstance(error, dict) and isinstance(error.get("code"), str):
            self.error_code = error["code"]


# The `usage` key of a JSON answer. A key: a string value holding these characters would
# have its quotes escaped, so only keys match. The object after it is small.
_USAGE_KEY = b'"usage":'
_MAX_USAGE_BYTES = 16 * 1024


class JsonUsage:
    """Fed a JSON answer chunk by chunk (it may be far larger than anything the router
    keeps); reads the object after its last `"usage":` key, holding at most
    _MAX_USAGE_BYTES of it and the few bytes of a key split between two chunks."""

    def __init__(self) -> None:
        self.usage: CachedTokens | None = None
        self._carry = b""  # the end of the last chunk: the start of a split key
        self._value: bytearray | None = None  # bytes after a key, until they parse

    def feed(self, chunk: bytes) -> None:
        data = self._carry + chunk
        at = data.rfind(_USAGE_KEY)
        rest = chunk  # what follows the bytes already read
        if at >= 0:
            self._value = bytearray()
            rest = data[at + len(_USAGE_KEY) :]
        if self._value is not None:
            self._value += rest[: _MAX_USAGE_BYTES - len(self._value)]
            self._parse()
        self._carry = data[-(len(_USAGE_KEY) - 1) :]

    def _parse(self) -> None:
        assert self._value is not None
        text = self._value.decode("utf-8", "replace").lstrip()
        try:
            value, _ = json.JSONDecoder().raw_decode(text)
        except ValueError:
            if len(self._value) >= _MAX_USAGE_BYTES:
                self._value = None  # not a usage object after all
            return  # else incomplete: more bytes to come
        self._value = None
        usage = usage_of({"usage": value})
        if usage is not None:
            self.usage = usage
