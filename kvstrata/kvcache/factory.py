"""Builds the engine's L1 prefix cache from its settings: the one place that chooses
between `RadixCache` and `NoPrefixCache`."""

from __future__ import annotations

from kvstrata.kvcache.base import PrefixCache
from kvstrata.kvcache.nocache import NoPrefixCache
from kvstrata.kvcache.pages import PageAllocator
from kvstrata.kvcache.radix import RadixCache, check_eviction_policy


def make_prefix_cache(
    allocator: PageAllocator, page_size: int, enabled: bool, eviction_policy: str = "lru"
) -> PrefixCache:
    """A `RadixCache` with `eviction_policy` ("lru" | "lfu"), or a `NoPrefixCache` when
    the radix cache is disabled (the policy is still validated, so a typo never hides
    behind a disabled cache)."""
    check_eviction_policy(eviction_policy)
    if not enabled:
        return NoPrefixCache(allocator, page_size)
    return RadixCache(allocator, page_size, eviction_policy)
