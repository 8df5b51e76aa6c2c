"""The `mooncake` L3 backend against a real `mooncake_master` on loopback: the storage
contract, integrity checks, and a master that dies, freezes and comes back."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import storage_contract as contract
import torch
from mooncake_fixtures import MooncakeMaster

from kvstrata.kvcache.storage import make_storage_backend
from kvstrata.kvcache.storage.mooncake import MooncakeStorage
from kvstrata.kvcache.storage.page_format import HEADER_BYTES, encode_header

PAGE_BYTES = contract.PAGE_BYTES
HANG_LIMIT_S = 60.0  # far above any timeout below: only a hang gets near it


@pytest.fixture
def open_backend(mooncake_master: MooncakeMaster) -> Iterator[Callable[..., MooncakeStorage]]:
    """Makes Mooncake backends on the test's master; closes them after the test."""
    made: list[MooncakeStorage] = []

    def make(namespace: bytes = contract.NAMESPACE, **options: object) -> MooncakeStorage:
        backend = make_storage_backend(
            "mooncake", PAGE_BYTES, namespace, mooncake_master.storage_options(**options)
        )
        assert isinstance(backend, MooncakeStorage)
        made.append(backend)
        return backend

    yield make
    mooncake_master.thaw()  # calls stuck on a frozen master return, so close() is clean
    # The client library takes ~2 s to close: close them all at once.
    closers = [threading.Thread(target=backend.close) for backend in made]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join()


def returns_in_time(fn: Callable[[], Any]) -> Any:
    """fn() on a thread; fails the test if it has not returned within HANG_LIMIT_S."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(HANG_LIMIT_S)
    assert not thread.is_alive(), "the storage call hung"
    return result[0]


def raw_put(backend: MooncakeStorage, key: bytes, blob: bytes) -> None:
    """Stores `blob` under `key` behind the backend's back (as a foreign writer would)."""
    client = backend._client
    assert client is not None and client.remove(backend.store_key(key), True) in (0, -704)
    assert client.put(backend.store_key(key), blob) == 0


def test_contract_through_a_real_master(open_backend: Callable[..., MooncakeStorage]) -> None:
    # Staging for 3 pages: batches of 6 go through in several chunks.
    backend = open_backend(staging_bytes=3 * (HEADER_BYTES + PAGE_BYTES))
    for check in contract.ALL_CHECKS:
        check(backend)
    assert backend.stats().num_errors == 0


def test_a_second_client_reads_pages_the_first_wrote(
    open_backend: Callable[..., MooncakeStorage],
) -> None:
    writer, reader = open_backend(), open_backend()
    page_keys, pages = contract.keys(5), contract.random_pages(5, seed=9)
    assert writer.batch_set(page_keys, pages) == [True] * 5
    assert reader.batch_exists(page_keys) == 5
    out = contract.host_pool(5)
    assert reader.batch_get(page_keys, out) == [True] * 5
    assert all(torch.equal(got, want) for got, want in zip(out, pages))
    # Another namespace on the same master sees none of it and clears none of it.
    other = open_backend(namespace=contract.OTHER_NAMESPACE)
    assert other.batch_exists(page_keys) == 0
    assert other.clear() == 0
    assert reader.batch_exists(page_keys) == 5


def test_corrupt_foreign_and_short_objects_are_counted_misses(
    open_backend: Callable[..., MooncakeStorage],
) -> None:
    backend = open_backend()
    (key_flip, key_foreign, key_short), page = (
        contract.keys(3, salt=40),
        contract.random_pages(1)[0],
    )
    payload = page.numpy().tobytes()
    damaged = bytearray(encode_header(contract.NAMESPACE, key_flip, payload, backend.mac) + payload)
    damaged[HEADER_BYTES + 17] ^= 0x01
    raw_put(backend, key_flip, bytes(damaged))
    raw_put(
        backend,
        key_foreign,
        encode_header(contract.OTHER_NAMESPACE, key_foreign, payload, backend.mac) + payload,
    )
    raw_put(
        backend,
        key_short,
        encode_header(contract.NAMESPACE, key_short, payload, backend.mac) + payload[:100],
    )
    out = contract.host_pool(3)
    assert backend.batch_get([key_flip, key_foreign, key_short], out) == [False] * 3
    stats = backend.stats()
    assert (stats.num_corrupt_pages, stats.num_hits, stats.num_errors) == (3, 0, 0)
    # The bad objects are dropped, so a set stores a good copy and it reads back exact.
    deadline_s = time.monotonic() + 10
    while backend.batch_exists([key_flip]) and time.monotonic() < deadline_s:
        time.sleep(0.05)
    assert backend.batch_set([key_flip], [page]) == [True]
    assert backend.batch_get([key_flip], out[:1]) == [True] and torch.equal(out[0], page)


def test_master_killed_mid_run_gives_counted_misses_then_recovers(
    mooncake_master: MooncakeMaster, open_backend: Callable[..., MooncakeStorage]
) -> None:
    backend = open_backend(timeout_s=2.0, retry_interval_s=0.5)
    page_keys, pages = contract.keys(4), contract.random_pages(4, seed=5)
    assert backend.batch_set(page_keys[:2], pages[:2]) == [True, True]

    mooncake_master.kill()
    out = contract.host_pool(4)
    assert returns_in_time(lambda: backend.batch_exists(page_keys)) == 0
    assert returns_in_time(lambda: backend.batch_get(page_keys[:2], out[:2])) == [False, False]
    assert returns_in_time(lambda: backend.batch_set(page_keys[2:], pages[2:])) == [False] * 2
    stats = backend.stats()
    assert stats.num_errors >= 1 + 2  # the exists call (stops at its first key), the gets
    assert stats.num_set_failures == 2 and stats.num_hits == 0

    # A restarted master holds no pages, but the same backend works again once the
    # client library has re-registered with it.
    mooncake_master.start()
    deadline_s = time.monotonic() + 45
    while backend.batch_set(page_keys[:1], pages[:1]) != [True]:
        assert time.monotonic() < deadline_s, mooncake_master.log_tail()
        time.sleep(0.5)
    assert backend.batch_get(page_keys[:1], out[:1]) == [True] and torch.equal(out[0], pages[0])
    # So does a backend created after the restart.
    fresh = open_backend()
    assert fresh.batch_set(page_keys[2:], pages[2:]) == [True, True]
    assert fresh.batch_get(page_keys[2:], out[2:]) == [True, True]
    assert torch.equal(out[3], pages[3])


def test_frozen_master_times_out_calls_instead_of_hanging(
    mooncake_master: MooncakeMaster, open_backend: Callable[..., MooncakeStorage]
) -> None:
    backend = open_backend(timeout_s=1.0)
    page_keys, pages = contract.keys(3, salt=60), contract.random_pages(3, seed=6)
    assert backend.batch_set(page_keys, pages) == [True] * 3

    mooncake_master.freeze()  # sockets stay open, nothing answers: RPCs block ~30 s
    out = contract.host_pool(3)
    assert returns_in_time(lambda: backend.batch_get(page_keys, out)) == [False] * 3
    assert returns_in_time(lambda: backend.batch_exists(page_keys)) == 0
    assert returns_in_time(lambda: backend.batch_set(page_keys, pages)) == [False] * 3
    stats = backend.stats()
    assert stats.num_errors >= 3 and stats.num_set_failures == 3

    mooncake_master.thaw()  # the stuck calls now return, late
    deadline_s = time.monotonic() + 45
    while backend.batch_get(page_keys[:1], out[:1]) != [True]:
        assert time.monotonic() < deadline_s, mooncake_master.log_tail()
        time.sleep(0.5)
    assert torch.equal(out[0], pages[0])
    # The late answer of the timed-out get landed in staging, never in the caller's pages.
    assert not np.any(out[1].numpy()) and not np.any(out[2].numpy())


def test_master_down_at_start_up_gives_misses_until_it_comes_up(
    mooncake_master: MooncakeMaster, open_backend: Callable[..., MooncakeStorage]
) -> None:
    mooncake_master.kill()
    backend = returns_in_time(lambda: open_backend(setup_timeout_s=1.0, retry_interval_s=0.2))
    page_keys, pages = contract.keys(2, salt=80), contract.random_pages(2, seed=8)
    assert backend.batch_set(page_keys, pages) == [False, False]
    assert backend.batch_get(page_keys, contract.host_pool(2)) == [False, False]
    assert backend.batch_exists(page_keys) == 0
    stats = backend.stats()
    assert (stats.num_set_failures, stats.num_errors) == (2, 2 + 2)

    mooncake_master.start()
    deadline_s = time.monotonic() + 45
    while backend.batch_set(page_keys, pages) != [True, True]:
        assert time.monotonic() < deadline_s, mooncake_master.log_tail()
        time.sleep(0.2)
    out = contract.host_pool(2)
    assert backend.batch_get(page_keys, out) == [True, True]
    assert torch.equal(out[1], pages[1])
