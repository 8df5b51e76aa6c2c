"""The `StorageBackend` contract as reusable checks, run against every backend: the file
backend in tests/unit/test_storage.py, Mooncake in tests/e2e/test_mooncake_storage.py."""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from kvstrata.kvcache.hashing import namespace_seed, page_hashes
from kvstrata.kvcache.storage.base import StorageBackend, StorageStats

PAGE_BYTES = 4096 + 64  # not a power of two: catches size assumptions
NAMESPACE = namespace_seed("test-model", 4, "float16")
OTHER_NAMESPACE = namespace_seed("other-model", 4, "float16")


def keys(num_keys: int, salt: int = 0) -> list[bytes]:
    return page_hashes([salt + i for i in range(4 * num_keys)], 4, NAMESPACE)


def random_pages(num_pages: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (PAGE_BYTES,), dtype=torch.uint8, generator=generator)
        for _ in range(num_pages)
    ]


def host_pool(num_pages: int) -> list[torch.Tensor]:
    """Zeroed 1-D views into one pool tensor, like the L2 host pool hands out."""
    pool = torch.zeros((num_pages, PAGE_BYTES), dtype=torch.uint8)
    return [pool[i] for i in range(num_pages)]


def counts(stats: StorageStats) -> dict[str, int]:
    """The integer counters (timings vary)."""
    return {k: v for k, v in dataclasses.asdict(stats).items() if not k.endswith("_s")}


def check_round_trip(backend: StorageBackend) -> None:
    page_keys, pages = keys(6), random_pages(6)
    assert backend.batch_set(page_keys, pages) == [True] * 6
    out = host_pool(6)
    assert backend.batch_get(page_keys, out) == [True] * 6
    for got, want in zip(out, pages):
        assert torch.equal(got, want)
    # Reads in a different order and of a subset land in the right pages.
    out = host_pool(3)
    order = [4, 0, 2]
    assert backend.batch_get([page_keys[i] for i in order], out) == [True] * 3
    for got, i in zip(out, order):
        assert hashlib.sha256(got.numpy()).digest() == hashlib.sha256(pages[i].numpy()).digest()


def check_exists_counts_leading_keys_only(backend: StorageBackend) -> None:
    page_keys, pages = keys(6, salt=100), random_pages(6, seed=1)
    stored = [0, 1, 2, 4, 5]  # key 3 is missing
    assert backend.batch_set([page_keys[i] for i in stored], [pages[i] for i in stored]) == [
        True
    ] * len(stored)
    assert backend.batch_exists(page_keys) == 3
    assert backend.batch_exists(page_keys[:2]) == 2
    assert backend.batch_exists(page_keys[3:]) == 0
    assert backend.batch_exists(page_keys[4:]) == 2
    assert backend.batch_exists([]) == 0


def check_set_skips_present_keys_and_misses_are_plain(backend: StorageBackend) -> None:
    (key, absent), (first, second) = keys(2, salt=200), random_pages(2, seed=2)
    before = counts(backend.stats())
    assert backend.batch_set([key], [first]) == [True]
    assert backend.batch_set([key], [second]) == [True]  # present: skipped, not replaced
    out = host_pool(2)
    assert backend.batch_get([key, absent], out) == [True, False]
    assert torch.equal(out[0], first)
    after = counts(backend.stats())
    delta = {name: after[name] - before[name] for name in after}
    assert delta == {
        "num_gets": 2,
        "num_hits": 1,
        "num_misses": 1,
        "num_sets": 1,
        "num_set_skipped": 1,
        "num_set_failures": 0,
        "num_corrupt_pages": 0,  # an absent key is a miss, not a fault
        "num_mac_refused": 0,
        "num_errors": 0,
        "bytes_read": PAGE_BYTES,
        "bytes_written": PAGE_BYTES,
    }
    assert backend.stats().read_s >= 0 and backend.stats().write_s >= 0


def check_delete_and_clear(backend: StorageBackend) -> None:
    page_keys, pages = keys(4, salt=300), random_pages(4, seed=3)
    assert all(backend.batch_set(page_keys, pages))
    assert backend.delete([page_keys[0], keys(1, salt=999)[0]]) == 1
    assert backend.batch_exists(page_keys) == 0
    assert backend.batch_exists(page_keys[1:]) == 3
    assert backend.batch_get(page_keys[:1], host_pool(1)) == [False]
    assert backend.clear() >= 3
    assert backend.batch_exists(page_keys[1:]) == 0
    assert backend.clear() == 0


def check_argument_errors_raise(backend: StorageBackend) -> None:
    """Caller bugs (not storage faults) raise ValueError."""
    import pytest

    key = keys(1)[0]
    for bad in (
        torch.zeros(PAGE_BYTES - 1, dtype=torch.uint8),
        torch.zeros(PAGE_BYTES, dtype=torch.int8),
        torch.zeros((2, PAGE_BYTES // 2), dtype=torch.uint8),
        torch.zeros(2 * PAGE_BYTES, dtype=torch.uint8)[::2],
    ):
        with pytest.raises(ValueError):
            backend.batch_get([key], [bad])
        with pytest.raises(ValueError):
            backend.batch_set([key], [bad])
    with pytest.raises(ValueError):
        backend.batch_get([key, key], host_pool(1))
    with pytest.raises(ValueError):
        backend.batch_exists([b"not a hash"])


ALL_CHECKS = (
    check_round_trip,
    check_exists_counts_leading_keys_only,
    check_set_skips_present_keys_and_misses_are_plain,
    check_delete_and_clear,
    check_argument_errors_raise,
)
