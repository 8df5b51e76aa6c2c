"""Cross-GPU copy bandwidth (issue 10): the peer-to-peer peak between two GPUs (one large
contiguous copy, each direction) against the `ipc` transport's own write of scattered KV
pages from a pool on one GPU into a pool on the other (its Triton kernel storing into the
peer, and its torch gather/copy/scatter path), and the same writes within one GPU.

    python bench/p2p_bandwidth.py --json out.json [--src cuda:0 --dst cuda:1]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvstrata.disagg.transport.ipc import IpcReceiver, IpcSender
from kvstrata.kvcache.pages import KVPool


def seconds_per_call(fn: Callable[[], object], devices: list[torch.device], repeats: int) -> float:
    """Wall seconds per call of `fn` after one warm-up, every device synchronized."""

    def sync() -> None:
        for device in devices:
            torch.cuda.synchronize(device)

    fn()
    sync()
    start_s = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start_s) / repeats


def contiguous_gbps(src: torch.device, dst: torch.device, num_bytes: int) -> float:
    a = torch.empty(num_bytes, dtype=torch.uint8, device=src)
    b = torch.empty(num_bytes, dtype=torch.uint8, device=dst)
    return num_bytes / seconds_per_call(lambda: b.copy_(a, non_blocking=True), [src, dst], 10) / 1e9


def transport_gbps(
    src: torch.device,
    dst: torch.device,
    args: argparse.Namespace,
    dtype: torch.dtype,
    use_kernel: bool,
) -> float:
    """IpcSender.write of --write-pages scattered pages from a pool on `src` into a pool on
    `dst` (same process: the receiver's pool is reached directly, as CUDA IPC maps it)."""
    dims = (args.page_size, args.layers, args.kv_heads, args.head_dim)
    local = KVPool(args.pool_pages, *dims, dtype, src)
    remote = KVPool(args.pool_pages, *dims, dtype, dst)
    local.data.normal_()
    receiver = IpcReceiver(remote, None)
    sender = IpcSender(local, use_kernel=use_kernel)
    rng = random.Random(0)
    src_pages = rng.sample(range(args.pool_pages), args.write_pages)
    dst_pages = rng.sample(range(args.pool_pages), args.write_pages)
    endpoint = receiver.endpoint()
    write_s = seconds_per_call(
        lambda: sender.write(endpoint, src_pages, dst_pages), [src, dst], args.repeats
    )
    index = torch.tensor(dst_pages, device=dst)
    assert not sender._direct_only, "the kernel path fell back to torch"
    assert torch.equal(
        remote.data[:, :, index].to(src), local.data[:, :, torch.tensor(src_pages, device=src)]
    ), "the pages did not arrive intact"
    return args.write_pages * local.page_bytes / write_s / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default="cuda:0")
    parser.add_argument("--dst", default="cuda:1")
    parser.add_argument("--layers", type=int, default=36)  # qwen3-8b shapes
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--pool-pages", type=int, default=4096)
    parser.add_argument("--write-pages", type=int, default=1024)  # a 16k-token suffix
    parser.add_argument("--contiguous-bytes", type=int, default=1 << 30)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    src, dst = torch.device(args.src), torch.device(args.dst)
    dtype = torch.bfloat16
    results: dict[str, object] = {
        "gpus": [torch.cuda.get_device_name(d) for d in (src, dst)],
        "src": str(src),
        "dst": str(dst),
        "peer_access": torch.cuda.can_device_access_peer(src, dst),
        "page_bytes": KVPool.page_bytes_for(
            args.page_size, args.layers, args.kv_heads, args.head_dim, dtype
        ),
        "write_pages": args.write_pages,
        "p2p_peak_gbps": contiguous_gbps(src, dst, args.contiguous_bytes),
        "p2p_peak_reverse_gbps": contiguous_gbps(dst, src, args.contiguous_bytes),
        "same_gpu_copy_gbps": contiguous_gbps(src, src, args.contiguous_bytes),
    }
    for name, use_kernel in (("kernel", True), ("direct", False)):
        results[f"transport_{name}_cross_gpu_gbps"] = transport_gbps(
            src, dst, args, dtype, use_kernel
        )
        results[f"transport_{name}_same_gpu_gbps"] = transport_gbps(
            src, src, args, dtype, use_kernel
        )
    results["transport_vs_p2p_peak"] = (
        results["transport_kernel_cross_gpu_gbps"] / results["p2p_peak_gbps"]  # type: ignore[operator]
    )
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
