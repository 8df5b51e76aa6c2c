"""RadixCache: the L1 prefix index. A radix tree over page-aligned token keys whose nodes
(radix_node.py) own L1 page ids, with lock counts (pinned by running requests) and the
access statistics and the retention the lru / lfu / priority eviction policies read."""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence

from kvstrata.core import CacheHandle, PrefixMatch
from kvstrata.kvcache.base import PrefixCache, StaleHandle
from kvstrata.kvcache.pages import PageAllocator
from kvstrata.kvcache.radix_node import _Node, check_tree
from kvstrata.kvcache.retention import HeldHint, Retention

# Eviction order: the leaf with the smallest key goes first (`now_s`: the eviction's
# monotonic time). The node id makes the order total (and deterministic) when statistics
# tie. priority: the retention a request asked for (retention.py), then recency.
_EVICTION_KEYS: dict[str, Callable[[_Node, float], tuple[int, ...]]] = {
    "lru": lambda node, now_s: (node.last_access, node.node_id),
    "lfu": lambda node, now_s: (node.num_hits, node.last_access, node.node_id),
    "priority": lambda node, now_s: (
        node.retention.effective_priority(now_s - node.last_access_s),
        node.last_access,
        node.node_id,
    ),
}
EVICTION_POLICIES: tuple[str, ...] = tuple(_EVICTION_KEYS)


def check_eviction_policy(eviction_policy: str) -> None:
    """Raise ValueError unless `eviction_policy` names a known policy."""
    if eviction_policy not in _EVICTION_KEYS:
        raise ValueError(
            f"unknown radix eviction policy {eviction_policy!r}; "
            f"expected one of {', '.join(EVICTION_POLICIES)}"
        )


class RadixCache(PrefixCache):
    """Radix tree prefix cache over L1 pages. See `PrefixCache` for the contract.

    Evicts whole leaves, or the tail pages of one leaf when fewer pages are asked for, so
    `evict(n)` frees exactly min(n, num_evictable_pages) pages.
    """

    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        eviction_policy: str = "lru",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(allocator, page_size)
        check_eviction_policy(eviction_policy)
        self.eviction_policy = eviction_policy
        self._eviction_key = _EVICTION_KEYS[eviction_policy]
        self._clock_s = clock
        self._node_ids = itertools.count()
        self._clock = 0
        self._root = self._new_node(None, (), [])
        self._num_cached_pages = 0
        self._num_locked_pages = 0  # pages of nodes with lock_count > 0
        # Called with the page ids `evict` is about to free, while their KV is still
        # intact, and the hint they held (a tiered cache copies them to L2 here).
        self.evict_listener: Callable[[list[int], HeldHint], None] | None = None

    # ---- queries -------------------------------------------------------------------

    @property
    def num_cached_pages(self) -> int:
        return self._num_cached_pages

    @property
    def num_locked_pages(self) -> int:
        return self._num_locked_pages

    def now_s(self) -> float:
        """The clock retention windows are measured on (monotonic seconds; a test's or
        the simulator's own when given)."""
        return self._clock_s()

    def cached_page_ids(self) -> set[int]:
        """Every page the tree caches (a walk: for integrity checks, not the hot path)."""
        return {page_id for node in self._nodes() for page_id in node.page_ids}

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        node, prefix_len = self._walk(self._aligned_key(token_ids))
        path = self._path_to_root(node)
        now, now_s = self._tick(), self._clock_s()
        for path_node in path:  # a hit renews the retention window (retention.py)
            path_node.last_access = now
            path_node.last_access_s = now_s
            path_node.num_hits += 1
        return PrefixMatch(prefix_len=prefix_len, page_ids=_pages_of(path), handle=node)

    # ---- locks ---------------------------------------------------------------------

    def lock(self, handle: CacheHandle) -> None:
        for node in self._path_to_root(self._as_node(handle)):
            if node.lock_count == 0:
                self._num_locked_pages += len(node.page_ids)
            node.lock_count += 1

    def unlock(self, handle: CacheHandle) -> None:
        path = self._path_to_root(self._as_node(handle))
        # Ancestors hold at least the handle's count, so checking the handle is enough
        # to know the whole walk below stays >= 0.
        if path[-1].lock_count < 1:
            raise RuntimeError(f"unlock of a handle that is not locked: {path[-1]!r}")
        for node in path:
            node.lock_count -= 1
            if node.lock_count == 0:
                self._num_locked_pages -= len(node.page_ids)

    @property
    def num_lock_pins(self) -> int:
        return self._root.lock_count  # every lock's path starts at the root

    def path_page_ids(self, handle: CacheHandle) -> list[int]:
        return _pages_of(self._path_to_root(self._as_node(handle)))

    def check_locks(self, handles: Sequence[CacheHandle]) -> list[str]:
        """Each node on the handles' paths, and the root (so a lock held off those paths
        shows too), has as many locks as handles whose path crosses it."""
        pins: Counter[int] = Counter()  # id(node) -> handles whose path crosses it
        nodes = {id(self._root): self._root}
        for handle in handles:
            try:
                path = self._path_to_root(self._as_node(handle))
            except StaleHandle:
                continue
            for node in path:
                pins[id(node)] += 1
                nodes[id(node)] = node
        return [
            f"L1: a tree node has {node.lock_count} lock(s), live requests hold {pins[key]}"
            for key, node in nodes.items()
            if node.lock_count != pins[key]
        ]

    # ---- mutation ------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], page_ids: Sequence[int]) -> int:
        self._check_insert_len(token_ids, page_ids)
        key = tuple(token_ids)
        node, prefix_len = self._walk(key)
        path = self._path_to_root(node)
        # Tokens [0, prefix_len) are already cached: keep the cache's page where the
        # caller handed back the same id, free the caller's duplicate otherwise.
        cached_page_ids = _pages_of(path)
        duplicate_page_ids = [
            page_id
            for page_id, cached_id in zip(page_ids, cached_page_ids, strict=False)
            if page_id != cached_id
        ]
        self.allocator.free(duplicate_page_ids)
        now, now_s = self._tick(), self._clock_s()
        for path_node in path:
            path_node.last_access = now
            path_node.last_access_s = now_s
        if prefix_len < len(key):
            # Tokens [prefix_len, len(key)) are new: one leaf under the match point.
            new_page_ids = list(page_ids[prefix_len // self.page_size :])
            leaf = self._new_node(node, key[prefix_len:], new_page_ids)
            node.children[leaf.key[: self.page_size]] = leaf
            self._num_cached_pages += len(new_page_ids)
        return prefix_len

    def retain(self, token_ids: Sequence[int], retention: Retention) -> None:
        """Every cached node on `token_ids`' path keeps the stronger of its retention and
        `retention` (so a shared prefix is never weaker than any request through it)."""
        node, _ = self._walk(self._aligned_key(token_ids))
        for path_node in self._path_to_root(node):
            path_node.retention = path_node.retention.stronger(retention)

    def reset_retention(
        self, token_ids: Sequence[int], keep_len: int, retention: Retention
    ) -> None:
        """The nodes of `token_ids`' path past token `keep_len` take `retention` in place
        of theirs, unless a branch below them keeps a stronger one (an ancestor is never
        weaker than a descendant); the node holding `keep_len` and those above keep theirs."""
        node, _ = self._walk(self._aligned_key(token_ids))
        path = self._path_to_root(node)
        starts = list(itertools.accumulate((len(n.key) for n in path), initial=0))
        for path_node, start in zip(reversed(path), reversed(starts[:-1])):
            if start < keep_len or path_node is self._root:
                break
            hint = retention
            for child in path_node.children.values():
                hint = hint.stronger(child.retention)
            path_node.retention = hint

    def evict(self, num_pages: int) -> int:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        now_s = self._clock_s()
        heap = [
            (self._eviction_key(node, now_s), node)
            for node in self._nodes()
            if self._is_evictable(node)
        ]
        heapq.heapify(heap)
        num_freed = 0
        while heap and num_freed < num_pages:
            _, leaf = heapq.heappop(heap)
            num_wanted = num_pages - num_freed
            if len(leaf.page_ids) > num_wanted:
                # Trim the tail: the leaf keeps its first pages, which are the ones a
                # future request sharing this prefix would reach first.
                self._evict_pages(leaf.page_ids[-num_wanted:], leaf)
                del leaf.page_ids[-num_wanted:]
                leaf.key = leaf.key[: len(leaf.page_ids) * self.page_size]
                num_freed += num_wanted
                break
            parent = leaf.parent
            assert parent is not None  # the root is never evictable
            num_freed += len(leaf.page_ids)
            self._evict_pages(leaf.page_ids, leaf)
            del parent.children[leaf.key[: self.page_size]]
            leaf.parent = None  # marks the node as gone: stale handles are refused
            leaf.page_ids = []
            if self._is_evictable(parent):
                heapq.heappush(heap, (self._eviction_key(parent, now_s), parent))
        return num_freed

    def reset(self) -> None:
        if self._root.lock_count > 0:
            raise RuntimeError(f"reset of a prefix cache with {self._root.lock_count} lock(s) held")
        for node in self._nodes():
            self._free_pages(node.page_ids)
            node.parent = None
        self._root = self._new_node(None, (), [])
        assert self._num_cached_pages == 0 and self._num_locked_pages == 0

    # ---- invariants ----------------------------------------------------------------

    def check_invariants(self) -> None:
        """`check_integrity` for tests: AssertionError naming the first violation."""
        violations = self.check_integrity()
        if violations:
            raise AssertionError(f"radix invariant broken: {violations[0]}")

    def _check_cache(self) -> list[str]:
        """The tree's own shape (`check_tree`), and the page / locked-page counters equal
        to what its walk counted."""
        census = check_tree(self._root, self.page_size, self.allocator)
        violations = census.violations
        if census.num_cached_pages != self._num_cached_pages:
            violations.append(
                f"radix: {census.num_cached_pages} pages in the tree, "
                f"counter says {self.num_cached_pages}"
            )
        if census.num_locked_pages != self._num_locked_pages:
            violations.append(
                f"radix: {census.num_locked_pages} locked in the tree, "
                f"counter: {self.num_locked_pages}"
            )
        return violations

    # ---- internals -----------------------------------------------------------------

    def _aligned_key(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        aligned_len = len(token_ids) // self.page_size * self.page_size
        return tuple(token_ids[:aligned_len])

    def _walk(self, key: tuple[int, ...]) -> tuple[_Node, int]:
        """Follow the page-aligned `key` down from the root as far as it is cached.
        Returns the node at the end of the match and the matched length; splits the last
        node when the match ends inside it, so the returned node ends exactly there."""
        node = self._root
        prefix_len = 0
        page_size = self.page_size
        while prefix_len < len(key):
            child = node.children.get(key[prefix_len : prefix_len + page_size])
            if child is None:
                break
            num_common = _common_len(child.key, key, prefix_len) // page_size * page_size
            prefix_len += num_common
            if num_common < len(child.key):
                # num_common >= page_size: the first page matched to find `child`.
                return self._split(child, num_common), prefix_len
            node = child
        return node, prefix_len

    def _split(self, node: _Node, head_len: int) -> _Node:
        """Cut `node` after `head_len` tokens; returns the new upper node.

            parent -> [ head | tail ]   becomes   parent -> [ head ] -> [ tail ] (node)

        Locks, hits and access time are copied to the head: every lock, hit and access
        that went through the tail went through the head too. `node` keeps its identity,
        so handles to it stay valid and still end at the same token position.
        """
        parent = node.parent
        assert parent is not None and 0 < head_len < len(node.key)
        num_head_pages = head_len // self.page_size
        head = self._new_node(parent, node.key[:head_len], node.page_ids[:num_head_pages])
        head.lock_count = node.lock_count
        head.num_hits = node.num_hits
        head.last_access = node.last_access
        head.last_access_s = node.last_access_s
        head.retention = node.retention
        parent.children[head.key[: self.page_size]] = head
        node.key = node.key[head_len:]
        node.page_ids = node.page_ids[num_head_pages:]
        node.parent = head
        head.children[node.key[: self.page_size]] = node
        return head

    def _new_node(self, parent: _Node | None, key: tuple[int, ...], page_ids: list[int]) -> _Node:
        return _Node(next(self._node_ids), parent, key, page_ids, self._clock, self._clock_s())

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _as_node(self, handle: CacheHandle) -> _Node:
        if not isinstance(handle, _Node):
            raise TypeError(f"not a RadixCache handle: {handle!r}")
        return handle

    def _path_to_root(self, node: _Node) -> list[_Node]:
        """Nodes from the root down to `node` (root first). Raises StaleHandle for a
        handle whose node was evicted or dropped by `reset` (it was not locked)."""
        path = [node]
        while path[-1].parent is not None:
            path.append(path[-1].parent)
        if path[-1] is not self._root:
            raise StaleHandle(f"stale handle (evicted or reset): {node!r}")
        path.reverse()
        return path

    def _nodes(self) -> list[_Node]:
        """Every node except the root."""
        nodes: list[_Node] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def _is_evictable(self, node: _Node) -> bool:
        return node is not self._root and not node.children and node.lock_count == 0

    def _evict_pages(self, page_ids: list[int], node: _Node) -> None:
        if self.evict_listener is not None:
            self.evict_listener(page_ids, HeldHint(node.retention, node.last_access_s))
        self._free_pages(page_ids)

    def _free_pages(self, page_ids: list[int]) -> None:
        self.allocator.free(page_ids)
        self._num_cached_pages -= len(page_ids)


def _common_len(node_key: tuple[int, ...], key: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of `node_key` and `key[start:]`."""
    num_common = 0
    for a, b in zip(node_key, key[start:], strict=False):
        if a != b:
            break
        num_common += 1
    return num_common


def _pages_of(path: list[_Node]) -> list[int]:
    return [page_id for node in path for page_id in node.page_ids]
