"""The radix tree's node (`_Node`): the fields RadixCache keeps per edge, the invariants
they hold, and `check_tree`, the walk that holds a whole tree to them."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from kvstrata.core import CacheHandle
from kvstrata.kvcache.pages import PageAllocator
from kvstrata.kvcache.retention import NO_RETENTION, Retention


class _Node(CacheHandle):
    """One edge of the tree and the pages under it; a RadixCache handle is the node where
    its match ends.

    Invariants (checked by `check_tree`, for `RadixCache.check_integrity`):
      - `len(key) == len(page_ids) * page_size`, and `key` is non-empty except at the root;
      - a node sits in `parent.children` under `key[:page_size]`, so siblings differ in
        their first page and branching happens at page granularity;
      - `lock_count` counts the locks whose path passes through this node, so it is never
        above the parent's; same for `num_hits` (a match touches the whole path) and
        `last_access` (touched together with the path): an ancestor is never colder than
        its descendants, so evicting leaves first agrees with either policy;
      - `retention` on a path is the stronger of every insert's through it (an ancestor's
        is never weaker than a descendant's), `last_access_s` its monotonic time.
    """

    __slots__ = (
        "children",
        "key",
        "last_access",
        "last_access_s",
        "lock_count",
        "node_id",
        "num_hits",
        "page_ids",
        "parent",
        "retention",
    )

    def __init__(
        self,
        node_id: int,
        parent: _Node | None,
        key: tuple[int, ...],
        page_ids: list[int],
        last_access: int,
        last_access_s: float = 0.0,
        retention: Retention = NO_RETENTION,
    ) -> None:
        self.node_id = node_id  # creation order: the final eviction tie-break
        self.parent = parent  # None for the root and for nodes removed from the tree
        self.key = key
        self.page_ids = page_ids
        self.children: dict[tuple[int, ...], _Node] = {}
        self.lock_count = 0
        self.last_access = last_access  # logical clock value, not wall time
        self.last_access_s = last_access_s  # monotonic seconds: retention decays by it
        self.retention = retention
        self.num_hits = 0

    def __repr__(self) -> str:
        return (
            f"_Node(id={self.node_id}, key_len={len(self.key)}, pages={self.page_ids}, "
            f"locks={self.lock_count}, hits={self.num_hits}, t={self.last_access})"
        )


class TreeCensus(NamedTuple):
    """What `check_tree` found: the violations, and the pages it counted on its walk (for
    the cache to hold against its own counters)."""

    violations: list[str]
    num_cached_pages: int
    num_locked_pages: int  # pages of nodes with lock_count > 0


def check_tree(root: _Node, page_size: int, allocator: PageAllocator) -> TreeCensus:
    """Walk the tree under `root`: node links and key shapes (see `_Node`), each page
    cached once and allocated in `allocator`, lock counts >= the sum of the children's
    (the rest are locks that end at the node)."""
    violations: list[str] = []
    fail = violations.append
    if root.parent is not None or root.key or root.page_ids:
        fail(f"radix: root must be parentless, keyless and pageless: {root!r}")
    seen_nodes: set[int] = set()
    seen_page_ids: set[int] = set()
    num_cached_pages = num_locked_pages = 0
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:
            fail(f"radix: node {node!r} reached twice (a cycle or a shared child)")
            continue
        seen_nodes.add(id(node))
        if node.lock_count < 0:
            fail(f"radix: negative lock count: {node!r}")
        num_cached_pages += len(node.page_ids)
        if node.lock_count > 0:
            num_locked_pages += len(node.page_ids)
        for page_id in node.page_ids:
            if page_id in seen_page_ids:
                fail(f"radix: page {page_id} cached twice")
            elif not 0 <= page_id < allocator.num_total_pages:
                fail(f"radix: page {page_id} is outside the pool")
            elif allocator.is_free(page_id):
                fail(f"radix: page {page_id} is cached but free in the allocator")
            seen_page_ids.add(page_id)
        child_locks = sum(child.lock_count for child in node.children.values())
        if child_locks > node.lock_count:
            fail(f"radix: children hold {child_locks} locks, more than {node!r}")
        for first_page, child in node.children.items():
            _check_child(node, first_page, child, page_size, fail)
            stack.append(child)
    return TreeCensus(violations, num_cached_pages, num_locked_pages)


def _check_child(
    node: _Node,
    first_page: tuple[int, ...],
    child: _Node,
    page_size: int,
    fail: Callable[[str], None],
) -> None:
    if child.parent is not node:
        fail(f"radix: child {child!r} does not point back to its parent {node!r}")
    if not child.key or len(child.key) % page_size:
        fail(f"radix: key length {len(child.key)} is not a positive page multiple")
    if len(child.key) != len(child.page_ids) * page_size:
        fail(f"radix: key covers {len(child.key)} tokens but has {child.page_ids}")
    if child.key[:page_size] != first_page:
        fail(f"radix: child {child!r} indexed under {first_page}")
    if child.num_hits > node.num_hits or child.last_access > node.last_access:
        fail(f"radix: child {child!r} is hotter than its parent {node!r}")
