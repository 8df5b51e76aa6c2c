"""The choices of one prompt (`n` > 1): choice 0 runs at once; choices 1..n-1 wait here
until choice 0 has computed the prompt, then join the queue, where the prefix cache serves
them the prompt's full pages (prefilled once). Each choice draws from its own seed."""

from __future__ import annotations

import dataclasses
import hashlib
import struct

from kvstrata.core import Request, SamplingParams

MAX_SEED = 2**63 - 1


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s params: choice 0 keeps the seed; the others get seeds derived from
    it (a hash, so choice j of seed s never equals choice 0 of a nearby seed)."""
    if index == 0 or params.seed is None:
        return params
    key = f"choice:{params.seed}".encode() + struct.pack("<Q", index)
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & MAX_SEED
    return dataclasses.replace(params, seed=seed)


class ChoiceForks:
    """Choices held back until their choice 0 has its prompt KV. Owned by the engine,
    which releases them (`take`) at choice 0's first token or end, whichever is first."""

    def __init__(self) -> None:
        self._held: dict[str, list[Request]] = {}  # choice 0's rid -> the other choices
        self._holder: dict[str, str] = {}  # held rid -> choice 0's rid

    @property
    def num_held(self) -> int:
        return len(self._holder)

    def hold(self, first: Request, others: list[Request]) -> None:
        self._held[first.rid] = others
        for req in others:
            self._holder[req.rid] = first.rid

    def take(self, rid: str) -> list[Request]:
        """The choices waiting for request `rid` (none if it holds none), released."""
        others = self._held.pop(rid, None)
        if others is None:
            return []
        for req in others:
            del self._holder[req.rid]
        return others

    def drop(self, req: Request) -> bool:
        """Forget a held choice that ends before it was released; False if not held."""
        first = self._holder.pop(req.rid, None)
        if first is None:
            return False
        self._held[first].remove(req)
        return True
