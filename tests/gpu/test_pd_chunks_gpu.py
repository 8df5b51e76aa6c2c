"""Issue 29's crash: a prefill rank's mooncake writes while its compute runs, at every
prefill chunk size, through every write path (plain, device staging, host staging; one
write at the end, or one per chunk). Prompts up to 4x the chunk; what lands in the decode
pool is the prefill pool's pages, bit for bit. And the gatherer's buffers never come from
a block the compute stream freed with kernels still queued to write it."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch

from kvstrata import LLM
from kvstrata.disagg.protocol import PrefillTask
from kvstrata.disagg.transport.mooncake import MooncakeReceiver
from kvstrata.disagg.transport.mooncake_coalesce import CoalescedWrite, Gatherer
from kvstrata.kvcache.pages import KVPool
from kvstrata.model.tiny import make_tiny_model

PAGE = 16
TCP = {"metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}
PATHS = {  # name -> (mooncake config, --stream-writes)
    "plain-serial": ({**TCP, "coalesce": False}, "off"),
    "plain-streamed": ({**TCP, "coalesce": False}, "on"),
    "device-staging-streamed": ({**TCP, "host_staging": "off"}, "on"),
    "host-staging-serial": ({**TCP, "host_staging": "on"}, "off"),
    "host-staging-streamed": ({**TCP, "host_staging": "on"}, "on"),
}


@pytest.fixture(scope="module")
def qwen3_06b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random bf16 weights with qwen3-0.6b's shapes: 32 KiB items, as qwen3-8b's."""
    pytest.importorskip("mooncake.engine")
    return make_tiny_model(tmp_path_factory.mktemp("q06"), preset="qwen3-0.6b", device="cuda")


@pytest.mark.parametrize("chunk_tokens", [1024, 2048, 4096, 8192])
@pytest.mark.parametrize("path", list(PATHS))
def test_prefill_chunks_land_bit_exact_on_every_write_path(
    qwen3_06b: Path, chunk_tokens: int, path: str
) -> None:
    config, stream = PATHS[path]
    prefill = LLM(
        str(qwen3_06b),
        device="cuda",
        page_size=PAGE,
        num_kv_pages=4 * 32768 // PAGE,
        max_model_len=32768 + 1,
        max_num_batched_tokens=chunk_tokens,
        disaggregation_mode="prefill",
        disaggregation_transfer_backend="mooncake",
        disaggregation_mooncake_config=json.dumps(config),
        stream_writes=stream,
        disable_cuda_graph=True,  # a prefill rank never decodes
    )
    dst = KVPool(2 * 32768 // PAGE, PAGE, 28, 8, 128, torch.bfloat16, "cuda")
    receiver = MooncakeReceiver(dst, json.dumps(config))
    rng = random.Random(chunk_tokens)
    try:
        # The first prompt is cold; the second extends it (its prefix is a cache hit).
        lengths = [2 * chunk_tokens + 5, 4 * chunk_tokens]
        prompt = [rng.randrange(1, 150_000) for _ in range(lengths[-1])]
        for turn, num_tokens in enumerate(lengths):
            tokens = prompt[:num_tokens]
            num_pages = -(-num_tokens // PAGE)
            dst_page_ids = rng.sample(range(dst.num_pages), num_pages)
            task = PrefillTask(
                room=f"r{turn}",
                token_ids=tokens,
                prefix_len=0,
                dst_page_ids=dst_page_ids,
                decode_endpoint=receiver.endpoint(),
                sampling={"temperature": 0.0},
            )
            engine = prefill.engine
            req = engine.role.add_prefill_task(task)
            while engine.has_unfinished:
                engine.step()
                if not engine.made_progress:
                    time.sleep(0.002)  # as the engine thread idles (runtime/engine_loop.py)
            result = engine.role.collect(req.rid)
            assert result.room == task.room
            match = engine.cache.match_prefix(tokens)  # the full pages, now cached
            assert match.prefix_len == num_tokens // PAGE * PAGE
            landed = dst.data[:, :, dst_page_ids[: match.num_pages]].view(torch.int16)
            computed = engine.pool.data[:, :, match.page_ids].view(torch.int16)
            assert torch.equal(landed, computed), f"turn {turn}: pages differ"
    finally:
        receiver.close()
        prefill.close()


def test_gatherer_buffers_never_alias_blocks_with_pending_writers() -> None:
    """Blocks of the gatherer's sizes are freed on the current stream while a kernel that
    writes them is still queued (behind ~0.2 s of spin); the gatherer made next must not
    get them, and its gather returns exactly the items asked for."""
    item_bytes, slot_bytes = 32 << 10, 8 << 20
    max_items = slot_bytes // item_bytes
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    ids_sized = torch.empty(max_items, dtype=torch.int64, device="cuda")
    scratch_sized = torch.empty(slot_bytes, dtype=torch.uint8, device="cuda")
    ids_sized.fill_(1 << 62)  # queued behind the spin
    scratch_sized.fill_(0xAB)
    freed = {ids_sized.data_ptr(), scratch_sized.data_ptr()}
    del ids_sized, scratch_sized
    for on_host in (True, False):
        gatherer = Gatherer(2, slot_bytes, on_host, torch.device("cuda"), item_bytes)
        mine = {gatherer.slots.data_ptr(), gatherer._ids.data_ptr()}
        if gatherer._scratch is not None:
            mine.add(gatherer._scratch.data_ptr())
        assert not mine & freed
        src_items = torch.randint(0, 255, (1024, item_bytes), dtype=torch.uint8, device="cuda")
        src_ids = torch.tensor(random.Random(1).sample(range(1024), max_items))
        write = CoalescedWrite(src_items, src_ids, src_ids.clone(), "s")
        gatherer.gather(write, 0, 0, max_items)
        gathered = gatherer.slots[0].view(max_items, item_bytes).to("cuda")
        assert torch.equal(gathered, src_items[src_ids.to("cuda")])
    torch.cuda.synchronize()
