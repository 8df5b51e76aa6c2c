"""kvstrata: LLM serving where KV computed once is never recomputed or re-sent. `LLM` is
imported on first use, so that `import kvstrata` (and the router) loads no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstrata.config import EngineConfig
from kvstrata.core import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from kvstrata.llm import LLM

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvstrata.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvstrata' has no attribute {name!r}")
