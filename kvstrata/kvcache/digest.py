"""CacheDigest: which chunk-boundary prefix hashes a rank can serve from L1 or L2, kept
exact incrementally from the tiers' page events, versioned, and sent as deltas. The wire
form (`DigestDelta`) and the router's copy (`DigestReplica`) are in digest_wire.py."""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Callable, Sequence

from kvstrata.kvcache.digest_wire import TIER_L1, TIER_L2, DigestDelta

__all__ = ["TIER_L1", "TIER_L2", "CacheDigest"]

_HISTORY_CHANGES = 1 << 16  # changes kept for deltas; an older version gets a snapshot


class CacheDigest:
    """The digest of one rank. Only the engine thread calls it.

    The page graph holds every page hash resident in L1 or L2, with its parent (the page
    before it). A page is *servable* when it and every page before it are resident:
    exactly what `HiRadixCache.match` can serve (L1 is prefix-closed, and L2 continues
    where L1 ends). The digest proper is {hash: tier} of the servable pages that end at a
    multiple of `chunk_size` tokens; tier is TIER_L1 if that page is in L1 (then so is its
    whole prefix), else TIER_L2. The tiers report page events (`add_chain`, `add_known`,
    `remove`, `clear`); each costs O(pages changed + descendants whose servability
    flips), never a walk of the whole cache. Entries exist once a chunk size is set (the
    first router poll); setting it walks the graph once. The graph is flat dicts of bytes
    and ints (no object per page), so it adds no garbage-collector work.

    Versions: changes accumulate until `delta_since` seals them as the next version (no
    change, no new version). A delta covers the versions after the caller's; a caller
    with another epoch (a restart, a flush, a new chunk size) or a version older than the
    kept history gets a full snapshot."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.chunk_size: int | None = None
        # Per resident page: its parent (None: first page of a sequence), its tiers
        # (TIER_L1 | TIER_L2 bits) and its depth (index in its sequence; -1: not servable).
        self._parent: dict[bytes, bytes | None] = {}
        self._tiers: dict[bytes, int] = {}
        self._depth: dict[bytes, int] = {}
        # Resident children of a hash, resident or not itself (an orphan becomes servable
        # again when its parent comes back): one child as bytes, several as a set.
        self._children: dict[bytes, bytes | set[bytes]] = {}
        self._entries: dict[bytes, int] = {}
        self._chunk_pages = 0  # chunk_size // page_size; 0: no entries kept
        # Called (on the engine thread) when the first change after a seal is recorded
        # and on every new epoch: a pushed-events publisher learns there is something to
        # send. It must not block (it hands a wake-up to another thread and returns).
        self.on_change: Callable[[], None] | None = None
        self._new_epoch()

    # -- page events (from the tiers) ---------------------------------------------------

    def add_chain(self, tier: int, page_hashes: Sequence[bytes], parent: bytes | None) -> None:
        """`page_hashes` are now in `tier`. They form a chain: each page follows the one
        before it, and the first follows `parent` (None: it starts a sequence)."""
        tiers, depths = self._tiers, self._depth
        # The depth of the page before, if it is servable (-1: before the first page).
        above = -1 if parent is None else self._servable_depth(parent)
        for page_hash in page_hashes:
            old_tiers = tiers.get(page_hash)
            if old_tiers is not None:
                self._set_tiers(page_hash, old_tiers | tier)
            else:
                self._parent[page_hash] = parent
                if parent is not None:
                    self._link(parent, page_hash)
                tiers[page_hash] = tier
                if above is None:
                    depths[page_hash] = -1
                elif page_hash in self._children:  # a returning parent of orphans
                    self._cascade(page_hash, servable=True, depth=above + 1)
                else:  # the common case, inlined: a new page after a servable one
                    depth = depths[page_hash] = above + 1
                    if self._chunk_pages and (depth + 1) % self._chunk_pages == 0:
                        self._set_entry(page_hash, tier)
            above = self._servable_depth(page_hash)
            parent = page_hash

    def add_known(self, tier: int, page_hashes: Sequence[bytes]) -> None:
        """Pages already resident in another tier are now also in `tier` (e.g. an L1
        page backed up to L2). Pages the digest does not know are skipped."""
        for page_hash in page_hashes:
            old_tiers = self._tiers.get(page_hash)
            if old_tiers is not None:
                self._set_tiers(page_hash, old_tiers | tier)

    def remove(self, tier: int, page_hashes: Sequence[bytes]) -> None:
        """`page_hashes` left `tier`. A page in no tier leaves the graph; every page
        after it stops being servable until it is back."""
        for page_hash in page_hashes:
            old_tiers = self._tiers.get(page_hash)
            if old_tiers is None or not old_tiers & tier:
                continue
            self._set_tiers(page_hash, old_tiers & ~tier)
            if self._tiers[page_hash]:
                continue
            del self._tiers[page_hash], self._depth[page_hash]
            parent = self._parent.pop(page_hash)
            if parent is not None:
                self._unlink(parent, page_hash)

    def clear(self) -> None:
        """Every tier was dropped (flush): empty, and a new epoch (routers resnapshot)."""
        for index in (self._parent, self._tiers, self._depth, self._children, self._entries):
            index.clear()
        self._new_epoch()

    # -- queries ------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return len(self._tiers)

    @property
    def entries(self) -> dict[bytes, int]:
        """{boundary hash: tier} (read-only view for tests and the simulator)."""
        return self._entries

    def delta_since(self, chunk_size: int, epoch: str | None, version: int | None) -> DigestDelta:
        """What changed since (`epoch`, `version`), at `chunk_size`-token boundaries.
        Raises ValueError if `chunk_size` is not a positive multiple of the page size."""
        if chunk_size != self.chunk_size:
            self._set_chunk_size(chunk_size)
        self._seal()
        oldest_base = self._history[0][0] - 1 if self._history else self.version
        if epoch != self.epoch or version is None or not oldest_base <= version <= self.version:
            return self._delta(True, None, dict(self._entries))
        changes: dict[bytes, int] = {}
        for sealed_version, sealed in self._history:
            if sealed_version > version:
                changes.update(sealed)
        if len(changes) > len(self._entries):
            return self._delta(True, None, dict(self._entries))
        return self._delta(False, version, changes)

    def check_invariants(self) -> None:
        """`check_integrity` for tests: AssertionError naming the first violation."""
        violations = self.check_integrity()
        assert not violations, violations[0]

    def check_integrity(self) -> list[str]:
        """Servability and entries against a rebuild: each page's depth must follow from
        its parent's (0 after None, parent + 1 after a servable parent, else -1), which
        by induction from the first pages is the depth a walk from scratch finds; the
        entries are then exactly the servable chunk-boundary pages; every child link
        names its parent."""
        violations: list[str] = []
        parents, depths, chunk_pages = self._parent, self._depth, self._chunk_pages
        expected: dict[bytes, int] = {}
        for page_hash, page_tiers in self._tiers.items():
            if not page_tiers:
                violations.append(f"digest: a page in no tier: {page_hash.hex()}")
            parent = parents.get(page_hash)
            if parent is None:
                depth = 0  # the first page of a sequence
            else:  # one deeper than a servable parent; -1 after a missing or unservable one
                parent_depth = depths.get(parent, -1)
                depth = parent_depth + 1 if parent_depth >= 0 else -1
            if depths.get(page_hash) != depth:
                violations.append(f"digest: wrong depth: {page_hash.hex()}")
            if depth >= 0 and chunk_pages and (depth + 1) % chunk_pages == 0:
                expected[page_hash] = TIER_L1 if page_tiers & TIER_L1 else TIER_L2
        if expected != self._entries:
            violations.append("digest: entries differ from a rebuild")
        for parent, kids in self._children.items():
            for child in (kids,) if isinstance(kids, bytes) else kids:
                if parents.get(child) != parent:
                    violations.append("digest: children index out of date")
        return violations

    # -- internals ----------------------------------------------------------------------

    def _new_epoch(self) -> None:
        self.epoch = secrets.token_hex(8)
        self.version = 0
        self._pending: dict[bytes, int] = {}  # hash -> tier, 0 = removed
        self._history: deque[tuple[int, dict[bytes, int]]] = deque()
        self._history_changes = 0
        if self.on_change is not None:
            self.on_change()

    def _set_chunk_size(self, chunk_size: int) -> None:
        if chunk_size < 1 or chunk_size % self.page_size:
            raise ValueError(
                f"digest chunk size {chunk_size} is not a positive multiple of the page size "
                f"{self.page_size}"
            )
        self.chunk_size = chunk_size
        self._chunk_pages = chunk_size // self.page_size
        self._entries = {
            h: TIER_L1 if self._tiers[h] & TIER_L1 else TIER_L2
            for h, depth in self._depth.items()
            if depth >= 0 and (depth + 1) % self._chunk_pages == 0
        }
        self._new_epoch()

    def _seal(self) -> None:
        if not self._pending:
            return
        self.version += 1
        self._history.append((self.version, self._pending))
        self._history_changes += len(self._pending)
        self._pending = {}
        while self._history_changes > _HISTORY_CHANGES and len(self._history) > 1:
            self._history_changes -= len(self._history.popleft()[1])

    def _delta(self, full: bool, base: int | None, changes: dict[bytes, int]) -> DigestDelta:
        assert self.chunk_size is not None
        return DigestDelta.of_changes(
            self.epoch, self.version, base, full, self.chunk_size, self.page_size, changes
        )

    def _set_tiers(self, page_hash: bytes, new_tiers: int) -> None:
        old_tiers = self._tiers[page_hash]
        self._tiers[page_hash] = new_tiers
        depth = self._depth[page_hash]
        if not new_tiers:
            if depth >= 0:
                self._cascade(page_hash, servable=False)
        elif depth >= 0:
            if (old_tiers ^ new_tiers) & TIER_L1 and page_hash in self._entries:
                self._set_entry(page_hash, TIER_L1 if new_tiers & TIER_L1 else TIER_L2)
        else:
            parent = self._parent[page_hash]
            above = -1 if parent is None else self._servable_depth(parent)
            if above is not None:
                self._cascade(page_hash, servable=True, depth=above + 1)

    def _servable_depth(self, page_hash: bytes) -> int | None:
        depth = self._depth.get(page_hash, -1)
        return depth if depth >= 0 else None

    def _cascade(self, page_hash: bytes, servable: bool, depth: int = -1) -> None:
        """Make `page_hash` (at `depth`) and its resident descendants that differ
        servable, or not."""
        stack = [(page_hash, depth)]
        while stack:
            h, d = stack.pop()
            self._depth[h] = d
            if servable and self._chunk_pages and (d + 1) % self._chunk_pages == 0:
                self._set_entry(h, TIER_L1 if self._tiers[h] & TIER_L1 else TIER_L2)
            elif not servable and h in self._entries:
                self._set_entry(h, 0)
            for child in self._children_of(h):
                if (self._depth[child] >= 0) != servable:
                    stack.append((child, d + 1 if servable else -1))

    def _children_of(self, page_hash: bytes) -> Sequence[bytes] | set[bytes]:
        kids = self._children.get(page_hash)
        if kids is None:
            return ()
        return (kids,) if isinstance(kids, bytes) else kids

    def _link(self, parent: bytes, child: bytes) -> None:
        kids = self._children.get(parent)
        if kids is None:
            self._children[parent] = child
        elif isinstance(kids, bytes):
            if kids != child:
                self._children[parent] = {kids, child}
        else:
            kids.add(child)

    def _unlink(self, parent: bytes, child: bytes) -> None:
        kids = self._children[parent]
        if isinstance(kids, bytes):
            del self._children[parent]
            return
        kids.discard(child)
        if len(kids) == 1:
            self._children[parent] = next(iter(kids))

    def _set_entry(self, page_hash: bytes, tier: int) -> None:
        if tier:
            self._entries[page_hash] = tier
        else:
            del self._entries[page_hash]
        if not self._pending and self.on_change is not None:
            self.on_change()  # once per version: later changes join the same one
        self._pending[page_hash] = tier
