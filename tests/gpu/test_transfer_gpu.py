"""Coalesced `mooncake` writes between GPU pools (gather and scatter as torch kernels on
CUDA, staging slots in GPU memory or pinned host memory): bit-exact and equal to the plain
path, bf16; a write reads its pages only after the kernels that wrote them."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvstrata.disagg.transport.mooncake import MooncakeReceiver, MooncakeSender
from kvstrata.kvcache.pages import KVPool

SHAPE = {"page_size": 16, "num_layers": 4, "num_kv_heads": 8, "head_dim": 128}  # 32 KiB items


def gpu_pool(num_pages: int, seed: int | None) -> KVPool:
    pool = KVPool(num_pages, dtype=torch.bfloat16, device="cuda", **SHAPE)
    if seed is not None:
        generator = torch.Generator(device="cuda").manual_seed(seed)
        pool.data.view(torch.int16).random_(generator=generator)  # every bit pattern
    return pool


def assert_lands_like_plain(
    config_json: str, src: KVPool, src_page_ids: list[int], dst_page_ids: list[int]
) -> None:
    """One coalesced write under `config_json` and one plain write of the same pages into
    two fresh 300-page pools: the same bits in both, and the source's bits where they
    landed."""
    staged_dst, plain_dst = gpu_pool(300, None), gpu_pool(300, None)
    receivers = [MooncakeReceiver(staged_dst, config_json), MooncakeReceiver(plain_dst, "{}")]
    staged, plain = MooncakeSender(src, config_json), MooncakeSender(src, '{"coalesce": false}')
    try:
        staged.write(receivers[0].endpoint(), src_page_ids, dst_page_ids)
        plain.write(receivers[1].endpoint(), src_page_ids, dst_page_ids)
        assert staged.num_writes == {"coalesced": 1, "plain": 0}
        assert torch.equal(staged_dst.data.view(torch.int16), plain_dst.data.view(torch.int16))
        landed = staged_dst.data[:, :, dst_page_ids].view(torch.int16)
        assert torch.equal(landed, src.data[:, :, src_page_ids].view(torch.int16))
    finally:
        staged.close()
        plain.close()
        for receiver in receivers:
            receiver.close()


@pytest.mark.parametrize("num_pages", [1, 37, 200])
def test_coalesced_gpu_writes_equal_the_plain_path(num_pages: int) -> None:
    pytest.importorskip("mooncake.engine")
    small_slots = json.dumps(
        {"staging_slot_bytes": 1 << 20, "staging_slots": 8, "host_staging": "off"}
    )
    rng = random.Random(num_pages)
    src_page_ids = rng.sample(range(256), num_pages)
    dst_page_ids = rng.sample(range(300), num_pages)
    assert_lands_like_plain(small_slots, gpu_pool(256, seed=num_pages), src_page_ids, dst_page_ids)


@pytest.mark.parametrize("consecutive", [False, True], ids=["scattered", "consecutive"])
def test_host_staging_lands_bit_exact(consecutive: bool) -> None:
    """Staging in pinned host memory at both ends: every write goes through it (consecutive
    pages too), and the gather -> host -> host -> pool path lands the same bits as the
    plain path."""
    pytest.importorskip("mooncake.engine")
    host_slots = json.dumps({"staging_slot_bytes": 1 << 20, "host_staging": True})
    rng = random.Random(3)
    src_page_ids = list(range(40, 140)) if consecutive else rng.sample(range(256), 100)
    dst_page_ids = list(range(150, 250)) if consecutive else rng.sample(range(300), 100)
    assert_lands_like_plain(host_slots, gpu_pool(256, seed=7), src_page_ids, dst_page_ids)


@pytest.mark.parametrize(
    "config_json",
    ['{"host_staging": "on"}', '{"host_staging": "off"}', '{"coalesce": false}'],
    ids=["host-staging", "device-staging", "plain"],
)
def test_a_write_reads_its_pages_after_the_kernels_that_wrote_them(config_json: str) -> None:
    """The pages are written on a side stream behind ~0.2 s of GPU spin, and the write
    starts with that stream current and nothing synchronized: what lands is the new
    bytes, never the zeros the pages held before."""
    pytest.importorskip("mooncake.engine")
    src, dst = gpu_pool(64, None), gpu_pool(64, None)
    receiver, sender = MooncakeReceiver(dst, config_json), MooncakeSender(src, config_json)
    page_ids = list(range(8, 40))
    expected = torch.empty_like(src.data).view(torch.int16)
    try:
        endpoint = receiver.endpoint()
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(400_000_000)  # cycles: ~0.2 s at H200 clocks
            expected.random_(generator=torch.Generator(device="cuda").manual_seed(5))
            src.data.view(torch.int16).copy_(expected)
            pending = sender.start(endpoint, page_ids, page_ids)
        while not pending.poll():
            pass
        landed = dst.data[:, :, page_ids].view(torch.int16)
        assert torch.equal(landed, expected[:, :, page_ids])
    finally:
        sender.close()
        receiver.close()
