"""What the L3 page MAC costs (issue 27.4): per-page time of the MAC (HMAC-SHA256) beside
the unkeyed checksum it replaced (xxh3-64) and a plain copy of the page, and the `file`
backend's write and warm read bandwidth of one batch of pages of one size with the
pages of the batch on 1-8 threads (its `threads` option), on this host's CPU.

    python bench/experiments/l3_page_mac_cost.py --page-bytes 2359296 --pages 256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

from kvstrata.kvcache.hashing import page_hashes
from kvstrata.kvcache.storage.file import FileStorage
from kvstrata.kvcache.storage.page_format import PageMac


def seconds_per_call(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    start_s = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start_s) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    # qwen3-8b: 36 layers x K,V x 16 tokens x 8 heads x 128 dims x bf16
    parser.add_argument("--page-bytes", type=int, default=2_359_296)
    parser.add_argument("--pages", type=int, default=128, help="pages of the file backend runs")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dir", default=os.environ.get("KVSTRATA_BENCH_DIR"))
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()

    payload = os.urandom(args.page_bytes)
    mac = PageMac(os.urandom(32))
    header = bytes(80)
    results: dict[str, float | int] = {"page_bytes": args.page_bytes, "pages": args.pages}
    for name, fn in (
        ("hmac_sha256", lambda: mac.tag(header, payload)),
        ("xxh3_64", lambda: xxhash.xxh3_64_intdigest(payload)),
        ("copy", lambda: bytearray(payload)),
    ):
        per_page_s = seconds_per_call(fn, args.repeats)
        results[f"{name}_ms_per_page"] = round(per_page_s * 1e3, 3)
        results[f"{name}_gbps"] = round(args.page_bytes / per_page_s / 1e9, 2)

    pages = [
        torch.frombuffer(bytearray(os.urandom(args.page_bytes)), dtype=torch.uint8)
        for _ in range(min(args.pages, 16))
    ]
    views = [pages[i % len(pages)] for i in range(args.pages)]
    keys = page_hashes(list(range(args.pages * 16)), 16, b"\x01" * 32)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        total_bytes = args.pages * args.page_bytes
        out = [torch.empty(args.page_bytes, dtype=torch.uint8) for _ in range(args.pages)]
        for num_threads in (1, 2, 4, 8):  # the backend's `threads` option: pages at once
            storage = FileStorage(
                Path(tmp) / f"l3-{num_threads}", args.page_bytes, b"\x00" * 32,
                threads=num_threads,
            )  # fmt: skip
            start_s = time.perf_counter()
            assert all(storage.batch_set(keys, views))
            write_s = time.perf_counter() - start_s
            storage.batch_get(keys, out)  # warm the page cache
            start_s = time.perf_counter()
            assert all(storage.batch_get(keys, out))
            read_s = time.perf_counter() - start_s
            storage.close()
            results[f"file_write_gbps_{num_threads}_threads"] = round(
                total_bytes / write_s / 1e9, 2
            )
            results[f"file_read_gbps_{num_threads}_threads"] = round(total_bytes / read_s / 1e9, 2)
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
