"""The cache usage a rank reports back (`usage.kvstrata` of a JSON answer, or of the last
SSE event that carries one), read by the router to compare its estimates with real hits."""

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
            int(usage.get("prompt_tokens", 0)), int(tiers.get("cached_tokens_l1", 0)),
            int(tiers.get("cached_tokens_l2", 0)), int(tiers.get("cached_tokens_l3", 0)),
        )  # fmt: skip
    except (TypeError, ValueError):
        return None


def usage_of_json(content: bytes) -> CachedTokens | None:
    try:
        return usage_of(json.loads(content))
    except ValueError:
        return None


class SseUsage:
    """Fed an SSE body chunk by chunk (events may straddle chunks); keeps the last usage
    seen. Only `data:` lines that mention kvstrata are parsed."""

    def __init__(self) -> None:
        self.usage: CachedTokens | None = None
        self._partial = b""

    def feed(self, chunk: bytes) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if line.startswith(b"data: ") and b'"kvstrata"' in line:
                usage = usage_of_json(line[len(b"data: ") :])
                if usage is not None:
                    self.usage = usage
