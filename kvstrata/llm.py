"""The offline API: `LLM(model=DIR, **config).generate(...)` runs requests to completion
on an in-process engine; `with LLM(...) as llm:` (or `close()`) releases the engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstrata.config import EngineConfig
from kvstrata.core import RequestOutput, SamplingParams
from kvstrata.disagg.factory import PD_ROLES
from kvstrata.engine.engine import Engine


class LLM:
    def __init__(self, model: str, **config: Any) -> None:
        self.engine = Engine(EngineConfig.from_flags(model=str(model), **config), PD_ROLES)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = Engine(config, PD_ROLES)
        return llm

    def close(self) -> None:
        """Release the engine's pool, transports and storage (`Engine.close`); idempotent."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        input_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """One finished output per prompt and choice, in order (`params.n` choices of
        each prompt in a row). Give `prompts` (text, tokenized with the model's tokenizer)
        or `input_ids`, not both."""
        prompt_ids = self._prompt_ids(prompts, input_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_ids)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_ids):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompt_ids)} prompts"
                )
        # Validate everything before queueing anything, so a bad prompt queues nothing.
        for ids, params in zip(prompt_ids, params_list):
            self.engine.validate(ids, params)
        rids = []
        for ids, params in zip(prompt_ids, params_list):
            choice_rids = [self.engine.new_rid() for _ in range(params.n)]
            rids += [req.rid for req in self.engine.add_choices(ids, params, choice_rids)]
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(rids):
            for out in self.engine.step():
                if out.finished:
                    finished[out.rid] = out
        return [finished[rid] for rid in rids]

    def _prompt_ids(
        self, prompts: str | Sequence[str] | None, input_ids: Sequence[Sequence[int]] | None
    ) -> list[list[int]]:
        if (prompts is None) == (input_ids is None):
            raise ValueError("give exactly one of prompts= or input_ids=")
        if input_ids is not None:
            return [list(ids) for ids in input_ids]
        if self.engine.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass input_ids= instead")
        texts = [prompts] if isinstance(prompts, str) else list(prompts or [])
        return [self.engine.tokenizer.encode(text) for text in texts]
