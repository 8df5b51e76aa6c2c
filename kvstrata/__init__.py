"""kvstrata: LLM serving where KV computed once is never recomputed or re-sent."""

from kvstrata.config import EngineConfig
from kvstrata.core import RequestOutput, SamplingParams
from kvstrata.llm import LLM

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]
