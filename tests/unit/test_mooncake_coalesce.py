"""Coalesced `mooncake` writes (staging + scatter) on the real Transfer Engine, tcp: byte-
exact and equal to the plain path for random page sets, edge cases, the fallback when
the decode rank has no slot free, and failures mid-write (the staging server's own checks:
test_mooncake_staging_security.py)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_mooncake_transport import ReceiverProcess, as_bytes, make_pool

from kvstrata.disagg.transport.base import WRITTEN, TransferError
from kvstrata.disagg.transport.mooncake import MooncakeReceiver, MooncakeSender
from kvstrata.disagg.transport.mooncake_plan import worth_coalescing

# 4 KiB slots hold 16 items of 256 bytes (LAYOUT's page of one plane): most writes take
# several chunks, more than a link's 4 slots, so slots are reused within a write.
SMALL_SLOTS = json.dumps({"staging_slot_bytes": 4096, "staging_slots": 8, "timeout_s": 2.0})
PLAIN = json.dumps({"coalesce": False, "timeout_s": 2.0})
SRC_PAGES, DST_PAGES = 48, 64


@dataclass(frozen=True)
class KVPoolPair:
    coalesced: MooncakeReceiver  # written through its staging slots
    plain: MooncakeReceiver  # no staging: written run by run


@pytest.fixture(scope="module")
def ends() -> Iterator[tuple[KVPoolPair, MooncakeSender, MooncakeSender]]:
    """A source pool, a coalescing and a plain sender, and one receiver for each."""
    from mooncake_fixtures import require_mooncake

    require_mooncake()
    src = make_pool(SRC_PAGES, torch.float32, seed=11)
    pair = KVPoolPair(
        MooncakeReceiver(make_pool(DST_PAGES, torch.float32), SMALL_SLOTS),
        MooncakeReceiver(make_pool(DST_PAGES, torch.float32), PLAIN),
    )
    coalescing, plain = MooncakeSender(src, SMALL_SLOTS), MooncakeSender(src, PLAIN)
    yield pair, coalescing, plain
    coalescing.close()
    plain.close()
    pair.coalesced.close()
    pair.plain.close()


def pages(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    num_pages = draw(st.integers(1, SRC_PAGES))
    src = draw(st.lists(st.integers(0, SRC_PAGES - 1), min_size=num_pages, max_size=num_pages))
    dst = draw(st.permutations(range(DST_PAGES)))[:num_pages]
    return src, list(dst)


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_coalesced_writes_equal_the_plain_path(ends: tuple, data: st.DataObject) -> None:
    pair, coalescing, plain = ends
    src_page_ids, dst_page_ids = pages(data.draw)
    before = coalescing.num_writes["coalesced"]
    coalescing.write(pair.coalesced.endpoint(), src_page_ids, dst_page_ids)
    plain.write(pair.plain.endpoint(), src_page_ids, dst_page_ids)
    assert coalescing.num_writes["coalesced"] == before + 1
    assert torch.equal(as_bytes(pair.coalesced.pool.data), as_bytes(pair.plain.pool.data))
    landed = pair.coalesced.pool.data[:, :, dst_page_ids]
    assert torch.equal(as_bytes(landed), as_bytes(coalescing.pool.data[:, :, src_page_ids]))


def test_edge_cases(ends: tuple) -> None:
    pair, coalescing, _ = ends
    endpoint, src = pair.coalesced.endpoint(), coalescing.pool.data
    assert coalescing.start(endpoint, [], []) is WRITTEN
    cases = [([7], [63]), (list(range(20, 40)), list(range(10, 30))), ([0] * 3, [5, 1, 60])]
    for src_page_ids, dst_page_ids in cases:  # one page; consecutive; one page thrice
        coalescing.write(endpoint, src_page_ids, dst_page_ids)
        landed = pair.coalesced.pool.data[:, :, dst_page_ids]
        assert torch.equal(as_bytes(landed), as_bytes(src[:, :, src_page_ids]))


def test_large_runs_are_written_plainly() -> None:
    qwen3_chunk_bytes = 16 * 8 * 128 * 2  # 32 KiB
    assert worth_coalescing(qwen3_chunk_bytes, [0, 5, 9], [3, 1, 7])
    assert not worth_coalescing(qwen3_chunk_bytes, list(range(64)), list(range(100, 164)))
    assert not worth_coalescing(qwen3_chunk_bytes, [0, 1, 2, 3, 9, 10, 11, 12], list(range(8)))
    assert not worth_coalescing(4 << 20, [0, 5], [3, 1])  # pages big enough on their own


@pytest.mark.usefixtures("mooncake_installed")
def test_no_free_slot_falls_back_to_plain_writes() -> None:
    one_slot = json.dumps({"staging_slot_bytes": 4096, "staging_slots": 1})
    src = make_pool(16, torch.float32, seed=12)
    receiver = MooncakeReceiver(make_pool(16, torch.float32), one_slot)
    first, second = MooncakeSender(src, one_slot), MooncakeSender(src, one_slot)
    try:
        endpoint = receiver.endpoint()
        first.write(endpoint, [1, 5, 9], [2, 0, 7])  # leases the only slot
        second.write(endpoint, [3, 4, 10], [15, 8, 11])
        assert (first.num_writes, second.num_writes) == (
            {"coalesced": 1, "plain": 0},
            {"coalesced": 0, "plain": 1},
        )
        got = receiver.pool.data[:, :, [2, 0, 7, 15, 8, 11]]
        assert torch.equal(got, src.data[:, :, [1, 5, 9, 3, 4, 10]])
    finally:
        first.close()
        second.close()
        receiver.close()


@pytest.mark.usefixtures("mooncake_installed")
@pytest.mark.parametrize("fault", ["sigstop", "sigkill"])
def test_a_failure_mid_write_fails_the_write(fault: str) -> None:
    config_json = json.dumps({"staging_slot_bytes": 4096, "timeout_s": 1.0})
    num_pages = 2048
    src = make_pool(num_pages, torch.float32, seed=13)
    peer = ReceiverProcess(num_pages, torch.float32, config_json)
    sender = MooncakeSender(src, config_json)
    try:
        endpoint = peer.endpoint()
        sender.write(endpoint, [0], [0])  # first contact
        # 2048 pages x 6 planes in 16-item chunks: 768 round trips through 4 slots.
        pending = sender.start(endpoint, list(range(num_pages)), list(range(num_pages))[::-1])
        time.sleep(0.01)
        assert not pending.poll(), "the write ended before the fault: make it longer"
        peer.signal(signal.SIGSTOP if fault == "sigstop" else signal.SIGKILL)
        start_s = time.monotonic()
        with pytest.raises(TransferError, match=r"failed|no transfer finished"):
            while not pending.poll():
                time.sleep(0.005)
        assert time.monotonic() - start_s < 4.0
        assert sender.num_writes["coalesced"] == 2
    finally:
        peer.kill()
        sender.close()


@pytest.fixture
def mooncake_installed() -> None:
    from mooncake_fixtures import require_mooncake

    require_mooncake()
