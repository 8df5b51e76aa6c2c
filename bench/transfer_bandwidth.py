"""Mooncake tcp bandwidth (issue 17.1), one process, one run: the raw Transfer Engine by
transfer size (two engines, one buffer into another) against the `mooncake` transport
writing a room of N pages scattered as a decode rank's allocator hands them out after
churn, plainly (one transfer per run of pages) and coalesced (staging + scatter).

    PYTHONPATH=. python bench/transfer_bandwidth.py --json out.json [--device cuda]
        [--room-pages 64,256,1024] [--raw-bytes 268435456]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path
from typing import Any

import torch

from kvstrata.config.mooncake import MooncakeTransportConfig
from kvstrata.disagg.transport.mooncake import MooncakeReceiver, MooncakeSender, start_engine
from kvstrata.disagg.transport.mooncake_plan import MAX_TRANSFER_BYTES, page_runs
from kvstrata.kvcache.pages import KVPool, PageAllocator

RAW_CHUNK_BYTES = [32 << 10, 64 << 10, 128 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
_RAW_BATCH_BYTES = 32 << 20  # what one batch keeps in flight (the transport's own limit)


def raw_gbps(device: str, total_bytes: int, chunk_bytes: int, repeats: int) -> float:
    """Best of `repeats`: `total_bytes` as `chunk_bytes` transfers, batches of 32 MiB
    through batch_transfer_sync_write, from one engine's buffer into another's."""
    config = MooncakeTransportConfig()
    (sender, _), (receiver, session) = start_engine(config), start_engine(config)
    src = torch.randint(0, 255, (total_bytes,), dtype=torch.uint8, device=device)
    dst = torch.zeros(total_bytes, dtype=torch.uint8, device=device)
    assert sender.register_memory(src.data_ptr(), total_bytes) == 0
    assert receiver.register_memory(dst.data_ptr(), total_bytes) == 0
    assert sender.send_probe(session) == 0
    offsets = list(range(0, total_bytes - chunk_bytes + 1, chunk_bytes))
    per_batch = max(1, _RAW_BATCH_BYTES // chunk_bytes)
    best_s = float("inf")
    for _ in range(repeats):
        start_s = time.perf_counter()
        for i in range(0, len(offsets), per_batch):
            batch = offsets[i : i + per_batch]
            rc = sender.batch_transfer_sync_write(
                session, [src.data_ptr() + o for o in batch], [dst.data_ptr() + o for o in batch],
                [chunk_bytes] * len(batch),
            )  # fmt: skip
            assert rc == 0, f"raw transfer failed: {rc}"
        best_s = min(best_s, time.perf_counter() - start_s)
    moved = len(offsets) * chunk_bytes
    assert torch.equal(src[:moved], dst[:moved]), "raw bytes did not arrive intact"
    sender.unregister_memory(src.data_ptr())
    receiver.unregister_memory(dst.data_ptr())
    return moved / best_s / 1e9


def churned_pages(num_pool_pages: int, num_pages: int, seed: int) -> list[int]:
    """`num_pages` ids from a PageAllocator after churn: rooms of 32-1024 pages arrive,
    grow one page per 16 decode steps interleaved with each other, and finish."""
    rng = random.Random(seed)
    allocator = PageAllocator(num_pool_pages)
    running: list[list[Any]] = []  # [page ids, steps left]
    for _ in range(3000):
        if rng.random() < 0.05:
            size = rng.choice([32, 64, 128, 256, 1024])
            if allocator.num_free_pages >= size + num_pages + 64:
                running.append([allocator.alloc(size), rng.randint(50, 2000)])
        for room in list(running):
            room[1] -= 1
            if room[1] % 16 == 0 and allocator.num_free_pages > num_pages + 64:
                room[0] += allocator.alloc(1)
            if room[1] <= 0:
                allocator.free(room[0])
                running.remove(room)
    return allocator.alloc(num_pages)


def transport_gbps(
    sender: MooncakeSender,
    receiver: MooncakeReceiver,
    src_page_ids: list[int],
    dst_page_ids: list[int],
    repeats: int,
) -> float:
    """Best of `repeats` writes of the room, checked byte-exact after the last."""
    endpoint = receiver.endpoint()
    sender.write(endpoint, src_page_ids[:1], dst_page_ids[:1])  # first contact
    best_s = float("inf")
    for _ in range(repeats):
        start_s = time.perf_counter()
        sender.write(endpoint, src_page_ids, dst_page_ids)
        best_s = min(best_s, time.perf_counter() - start_s)
    src_index = torch.tensor(src_page_ids, device=sender.pool.data.device)
    dst_index = torch.tensor(dst_page_ids, device=receiver.pool.data.device)
    landed = receiver.pool.data.index_select(2, dst_index).view(torch.int16)  # bits: NaN too
    sent = sender.pool.data.index_select(2, src_index).view(torch.int16)
    assert torch.equal(landed, sent), "pages corrupted"
    return len(src_page_ids) * sender.pool.page_bytes / best_s / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=36)  # qwen3-8b shapes
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--room-pages", default="64,256,1024")
    parser.add_argument("--raw-bytes", type=int, default=256 << 20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float16
    room_sizes = [int(n) for n in args.room_pages.split(",")]
    results: dict[str, Any] = {
        "machine": platform.node(), "cpu_count": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "date": time.strftime("%Y-%m-%d"), "protocol": "tcp", "dtype": str(dtype),
        "raw_gbps_by_chunk_bytes": {}, "transport": [],
    }  # fmt: skip
    for chunk_bytes in RAW_CHUNK_BYTES:
        gbps = raw_gbps(args.device, args.raw_bytes, chunk_bytes, args.repeats)
        results["raw_gbps_by_chunk_bytes"][chunk_bytes] = gbps
        print(f"raw  {chunk_bytes >> 10:>6} KiB transfers: {gbps:6.2f} GB/s", flush=True)
    raw_at_chosen = results["raw_gbps_by_chunk_bytes"][MAX_TRANSFER_BYTES]
    num_pool_pages = max(room_sizes) + 256
    dims = (args.page_size, args.layers, args.kv_heads, args.head_dim, dtype, args.device)
    src_pool, dst_pool = KVPool(num_pool_pages, *dims), KVPool(num_pool_pages, *dims)
    src_pool.data.view(torch.int16).random_()
    receiver = MooncakeReceiver(dst_pool, "{}")
    senders = {
        "plain": MooncakeSender(src_pool, '{"coalesce": false}'),
        "coalesced": MooncakeSender(src_pool, "{}"),
    }
    try:
        for num_pages in room_sizes:
            src_page_ids = churned_pages(num_pool_pages, num_pages, seed=num_pages)
            dst_page_ids = churned_pages(num_pool_pages, num_pages, seed=num_pages + 1)
            row = {
                "room_pages": num_pages, "room_bytes": num_pages * src_pool.page_bytes,
                "runs": len(page_runs(src_page_ids, dst_page_ids)),
                "dst_runs": len(page_runs(sorted(dst_page_ids), sorted(dst_page_ids))),
            }  # fmt: skip
            # Raw again beside each room (this box is shared: its speed drifts); the ratio
            # is to the better of that and the table's value.
            raw_now = raw_gbps(args.device, args.raw_bytes, MAX_TRANSFER_BYTES, args.repeats)
            row["raw_4mib_gbps_beside"] = raw_now
            for name, sender in senders.items():
                gbps = transport_gbps(sender, receiver, src_page_ids, dst_page_ids, args.repeats)
                row[f"{name}_gbps"] = gbps
                row[f"{name}_vs_raw"] = gbps / max(raw_at_chosen, raw_now)
            results["transport"].append(row)
            print(f"room {num_pages:>5} pages ({row['runs']} runs): plain "
                  f"{row['plain_gbps']:5.2f} GB/s ({row['plain_vs_raw']:4.0%} of raw at 4 MiB, "
                  f"{raw_now:.2f} GB/s beside), "
                  f"coalesced {row['coalesced_gbps']:5.2f} GB/s "
                  f"({row['coalesced_vs_raw']:4.0%})", flush=True)  # fmt: skip
    finally:
        for sender in senders.values():
            sender.close()
        receiver.close()
    text = json.dumps(results, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
