"""HiCache copy and storage bandwidth on one GPU (issue 4's benchmark): pinned H2D peak,
L2 -> L1 load-back of scattered pages (Triton kernel vs torch path), L1 -> L2 backup,
and the L3 file backend's read bandwidth against a plain sequential read of the same bytes.

    python bench/hicache_bandwidth.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvstrata.kvcache.copier import TorchCopier
from kvstrata.kvcache.hashing import page_hashes
from kvstrata.kvcache.host_pool import HostPool
from kvstrata.kvcache.pages import KVPool
from kvstrata.kvcache.storage.file import FileStorage


def timed_cuda(fn: Callable[[], object], repeats: int) -> float:
    """Seconds per call of `fn`, measured with CUDA events after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def pinned_h2d_peak(num_bytes: int) -> float:
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    return num_bytes / timed_cuda(lambda: dev.copy_(host, non_blocking=True), 10) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=36)  # qwen3-8b shapes
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--l1-pages", type=int, default=2048)
    parser.add_argument("--l2-pages", type=int, default=1024)
    parser.add_argument("--copy-pages", type=int, default=512)
    parser.add_argument("--l3-pages", type=int, default=256)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from kvstrata.kvcache.copier_triton import TritonCopier

    dtype = torch.bfloat16
    shape = (args.page_size, args.layers, args.kv_heads, args.head_dim)
    l1 = KVPool(args.l1_pages, shape[0], shape[1], shape[2], shape[3], dtype, "cuda")
    l2 = HostPool(args.l2_pages, shape[0], shape[1], shape[2], shape[3], dtype, pin_memory=True)
    l1.data.normal_()
    rng = random.Random(0)
    l1_pages = rng.sample(range(args.l1_pages), args.copy_pages)
    l2_pages = rng.sample(range(args.l2_pages), args.copy_pages)
    copy_bytes = args.copy_pages * l2.page_bytes
    results: dict[str, float | int | str] = {
        "gpu": torch.cuda.get_device_name(),
        "page_bytes": l2.page_bytes,
        "copy_pages": args.copy_pages,
        "pinned_h2d_peak_gbps": pinned_h2d_peak(copy_bytes),
    }
    for name, copier in (("kernel", TritonCopier(l1, l2)), ("direct", TorchCopier(l1, l2))):
        backup_s = timed_cuda(lambda c=copier: c.backup(l1_pages, l2_pages), 5)
        load_s = timed_cuda(lambda c=copier: c.load_back(l2_pages, l1_pages), 5)
        results[f"{name}_backup_gbps"] = copy_bytes / backup_s / 1e9
        results[f"{name}_load_back_gbps"] = copy_bytes / load_s / 1e9
    results["kernel_load_back_vs_peak"] = (
        results["kernel_load_back_gbps"] / results["pinned_h2d_peak_gbps"]
    )

    with tempfile.TemporaryDirectory(dir=os.environ.get("KVSTRATA_BENCH_DIR")) as tmp:
        storage = FileStorage(Path(tmp) / "l3", l2.page_bytes, b"\x00" * 32)
        keys = page_hashes(list(range(args.l3_pages * 16)), 16, b"\x01" * 32)
        pages = [l2.page_bytes_view(i % args.l2_pages) for i in range(args.l3_pages)]
        start_s = time.perf_counter()
        assert all(storage.batch_set(keys, pages))
        results["l3_file_write_gbps"] = args.l3_pages * l2.page_bytes / (
            time.perf_counter() - start_s
        ) / 1e9  # fmt: skip
        start_s = time.perf_counter()
        assert all(storage.batch_get(keys, pages))
        get_s = time.perf_counter() - start_s
        start_s = time.perf_counter()
        buffer = bytearray(storage.path_of(keys[0]).stat().st_size)
        for key in keys:
            with open(storage.path_of(key), "rb", buffering=0) as f:
                f.readinto(buffer)
        plain_s = time.perf_counter() - start_s
        results["l3_file_get_gbps"] = args.l3_pages * l2.page_bytes / get_s / 1e9
        results["plain_sequential_read_gbps"] = args.l3_pages * l2.page_bytes / plain_s / 1e9
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
