"""The cache digest on the wire and on the router: `DigestDelta` (what a rank's
`GET /get_load?digest_chunk_size=..` answers in `digest`) and `DigestReplica` (the
router's copy of one rank's digest, kept current by applying deltas)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

TIER_L1 = 1  # the boundary's whole prefix is in L1
TIER_L2 = 2  # servable, but part of it only from L2 (a host copy)


@dataclass(frozen=True)
class DigestDelta:
    """Changes of a digest from `base_version` to `version` (or, `full`, every entry).
    An entry in `added_l1` / `added_l2` is present with that tier (a tier change is a
    re-add); `removed` entries are gone. `namespace` is the page-hash seed and
    `page_size` the page length, so the router hashes request tokens the same way."""

    epoch: str
    version: int
    base_version: int | None  # None when `full`
    full: bool
    chunk_size: int
    page_size: int
    added_l1: tuple[bytes, ...]
    added_l2: tuple[bytes, ...]
    removed: tuple[bytes, ...]
    namespace: bytes = b""

    @classmethod
    def of_changes(
        cls,
        epoch: str,
        version: int,
        base_version: int | None,
        full: bool,
        chunk_size: int,
        page_size: int,
        changes: Mapping[bytes, int],
    ) -> DigestDelta:
        """From {hash: tier, 0 = removed}."""
        by_tier: dict[int, list[bytes]] = {TIER_L1: [], TIER_L2: [], 0: []}
        for page_hash, tier in changes.items():
            by_tier[tier].append(page_hash)
        return cls(
            epoch,
            version,
            base_version,
            full,
            chunk_size,
            page_size,
            tuple(by_tier[TIER_L1]),
            tuple(by_tier[TIER_L2]),
            tuple(by_tier[0]),
        )

    def with_namespace(self, namespace: bytes) -> DigestDelta:
        return replace(self, namespace=namespace)

    @property
    def num_changes(self) -> int:
        return len(self.added_l1) + len(self.added_l2) + len(self.removed)

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "version": self.version,
            "base_version": self.base_version,
            "full": self.full,
            "chunk_size": self.chunk_size,
            "page_size": self.page_size,
            "namespace": self.namespace.hex(),
            "added": [h.hex() for h in self.added_l1],
            "added_l2": [h.hex() for h in self.added_l2],
            "removed": [h.hex() for h in self.removed],
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> DigestDelta:
        """Raises ValueError (or KeyError/TypeError, re-raised as ValueError) if malformed."""
        try:
            base = body["base_version"]
            return cls(
                epoch=str(body["epoch"]),
                version=int(body["version"]),
                base_version=None if base is None else int(base),
                full=bool(body["full"]),
                chunk_size=int(body["chunk_size"]),
                page_size=int(body["page_size"]),
                added_l1=_hashes(body["added"]),
                added_l2=_hashes(body["added_l2"]),
                removed=_hashes(body["removed"]),
                namespace=bytes.fromhex(body["namespace"]),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed digest: {e!r}") from e


def _hashes(items: Sequence[str]) -> tuple[bytes, ...]:
    return tuple(bytes.fromhex(item) for item in items)


@dataclass(frozen=True)
class DigestMatch:
    """How much of a request a digest holds: whole chunks, and how many of those are in
    L1 (the rest would come from L2)."""

    num_chunks: int
    num_l1_chunks: int


class DigestReplica:
    """The router's copy of one rank's digest. Lives on the router's event loop."""

    def __init__(self) -> None:
        self.epoch: str | None = None
        self.version: int | None = None
        self.chunk_size = 0
        self.page_size = 0
        self.namespace = b""
        self.entries: dict[bytes, int] = {}  # boundary hash -> TIER_L1 | TIER_L2

    def apply(self, delta: DigestDelta) -> bool:
        """Apply a delta; False (and nothing changed) if it does not start at this copy's
        version, so the caller should ask for a snapshot."""
        if delta.full:
            self.entries = {}
        elif delta.epoch != self.epoch or delta.base_version != self.version:
            return False
        for page_hash in delta.removed:
            self.entries.pop(page_hash, None)
        for tier, added in ((TIER_L1, delta.added_l1), (TIER_L2, delta.added_l2)):
            for page_hash in added:
                self.entries[page_hash] = tier
        self.epoch, self.version = delta.epoch, delta.version
        self.chunk_size, self.page_size, self.namespace = (
            delta.chunk_size,
            delta.page_size,
            delta.namespace,
        )
        return True

    def query(self, chunk_size: int) -> dict[str, str | int]:
        """The /get_load query parameters that ask for the changes since this copy."""
        params: dict[str, str | int] = {"digest_chunk_size": chunk_size}
        if self.epoch is not None and self.version is not None:
            params |= {"digest_epoch": self.epoch, "digest_version": self.version}
        return params

    def match(
        self, boundary_hashes: Sequence[bytes], also: Mapping[bytes, Any] | None = None
    ) -> DigestMatch:
        """The deepest of `boundary_hashes` (a request's hashes at chunk boundaries, in
        order) present here or in `also` (counted as L1). A chained hash names its whole
        prefix, and the digest holds every boundary of a servable prefix, so presence is
        monotone along the request: binary search finds the deepest one."""
        entries = self.entries

        def present(i: int) -> bool:
            h = boundary_hashes[i]
            return h in entries or (also is not None and h in also)

        def in_l1(i: int) -> bool:
            h = boundary_hashes[i]
            return entries.get(h) == TIER_L1 or (also is not None and h in also)

        num_chunks = _num_leading(present, len(boundary_hashes))
        return DigestMatch(num_chunks, _num_leading(in_l1, num_chunks))


def _num_leading(holds: Any, n: int) -> int:
    """The number of leading indices in [0, n) where `holds` is true, for a predicate
    that is true on a prefix of [0, n) and false after it."""
    if n == 0 or holds(n - 1):
        return n
    lo, hi = 0, n - 1  # holds(hi) is false; answer in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if holds(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo
