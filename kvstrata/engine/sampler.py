"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeded
generators so a seeded request samples the same tokens whatever batch it rides in."""

from __future__ import annotations

import torch

from kvstrata.core import Request


class Sampler:
    def __init__(self, default_seed: int) -> None:
        self.default_seed = default_seed
        self._generators: dict[str, torch.Generator] = {}  # seeded requests only
        self._shared: dict[torch.device, torch.Generator] = {}  # unseeded requests

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """One token per row of `logits` ([num_requests, vocab], float32)."""
        if all(req.params.is_greedy for req in requests):
            return logits.argmax(dim=-1).tolist()
        token_ids: list[int] = []
        for row, req in zip(logits, requests):
            if req.params.is_greedy:
                token_ids.append(int(row.argmax()))
            else:
                token_ids.append(self._sample_row(row, req))
        return token_ids

    def _sample_row(self, row: torch.Tensor, req: Request) -> int:
        params = req.params
        scaled = row / params.temperature
        if params.top_k > 0 and params.top_k < scaled.numel():
            kth = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest set whose mass reaches top_p: a token stays if the mass
            # before it is still below top_p. The top token always stays, also when top_p
            # is below float32's range and compares as 0 (else no token would be left).
            mass_before = sorted_probs.cumsum(0) - sorted_probs
            drop = mass_before >= params.top_p
            drop[0] = False
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self._generator(req, row.device)))

    def _generator(self, req: Request, device: torch.device) -> torch.Generator:
        if req.params.seed is None:
            if device not in self._shared:
                self._shared[device] = _seeded(self.default_seed, device)
            return self._shared[device]
        if req.rid not in self._generators:
            self._generators[req.rid] = _seeded(req.params.seed, device)
        return self._generators[req.rid]

    def release(self, rid: str) -> None:
        self._generators.pop(rid, None)


def _seeded(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
