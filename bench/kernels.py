"""Kernel microbenchmarks behind the launch configs in attention/triton_tiles.py and
model/triton_ops.py: decode and extend attention tiles, and the batch-1 GEMV against
cuBLAS, on qwen3-8b / qwen3-0.6b shapes. Times are CUDA-graph replays (median).

    PYTHONPATH=. python bench/kernels.py [gemv,decode,decode_bs1,decode_fp8,extend,extend_fp8]"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

import torch
import triton
from triton.testing import do_bench_cudagraph

from kvstrata.attention.base import PagedTensors
from kvstrata.attention.triton_decode import decode_attention
from kvstrata.attention.triton_extend import extend_attention
from kvstrata.attention.triton_paged import num_decode_splits
from kvstrata.attention.triton_tiles import TileConfig
from kvstrata.model.triton_gemv import GemvConfig, gemv
from kvstrata.pdl import NO_PDL, Pdl

PAGE_SIZE = 16


def timed_us(fn: Any) -> float:
    return do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def paged_batch(kv_lens: list[int], num_kv_heads: int, head_dim: int) -> dict[str, Any]:
    """A pool holding exactly the batch's pages, in shuffled order."""
    pages_per_seq = [-(-n // PAGE_SIZE) for n in kv_lens]
    num_pages = sum(pages_per_seq)
    order = torch.randperm(num_pages).tolist()
    width = max(pages_per_seq)
    table = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    start = 0
    for i, count in enumerate(pages_per_seq):
        table[i, :count] = torch.tensor(order[start : start + count])
        start += count
    shape = (num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    return {
        "k": torch.randn(shape, device="cuda", dtype=torch.bfloat16),
        "v": torch.randn(shape, device="cuda", dtype=torch.bfloat16),
        "table": table.cuda(),
        "lens": torch.tensor(kv_lens, dtype=torch.int32, device="cuda"),
        "kv_bytes": 2 * sum(kv_lens) * num_kv_heads * head_dim * 2,
    }


def bench_decode() -> None:
    configs = [
        TileConfig(64, 4, 2),
        TileConfig(64, 4, 2, early_v=True),
        TileConfig(64, 4, 3, early_v=True),
        TileConfig(32, 4, 3, early_v=True),
        TileConfig(128, 4, 2, early_v=True),
        TileConfig(64, 8, 3, early_v=True),
        TileConfig(128, 8, 3, early_v=True),
    ]
    gen = torch.Generator().manual_seed(0)
    cases = {
        "8b bs256 ctx~576": (torch.randint(512, 641, (256,), generator=gen).tolist(), 32, 8),
        "0.6b bs256 ctx~576": (torch.randint(512, 641, (256,), generator=gen).tolist(), 16, 8),
        "8b bs1 ctx2048": ([2048], 32, 8),
        "8b bs16 ctx4096": ([4096] * 16, 32, 8),
    }
    print("decode attention: us (GB/s of KV read)")
    for name, (kv_lens, num_q_heads, num_kv_heads) in cases.items():
        batch = paged_batch(kv_lens, num_kv_heads, 128)
        q = torch.randn(len(kv_lens), num_q_heads, 128, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        splits = num_decode_splits(len(kv_lens), num_kv_heads, 132)
        row = []
        for config in configs:
            run = partial(
                decode_attention, q, batch["k"], batch["v"], batch["table"], batch["lens"],
                0.088, splits, out, config,
            )  # fmt: skip
            us = timed_us(run)
            row.append(f"{us:8.1f} ({batch['kv_bytes'] / us / 1e3:5.0f})")
        print(f"  {name:20s} splits={splits:2d} " + " ".join(row), flush=True)
    print("  configs:", [(c.block_n, c.num_warps, c.num_stages, c.early_v) for c in configs])


def bench_decode_batch1() -> None:
    """Batch-1 decode at 2k context (W2's attention): split counts, launched plainly and
    with programmatic dependent launch (PDL)."""
    batch = paged_batch([2048], 8, 128)
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    print("decode attention 8b bs1 ctx2048: us per call (plain / PDL)")
    for splits in (8, 16, 32):
        row = []
        for pdl in (NO_PDL, Pdl(True)):
            run = partial(
                decode_attention, q, batch["k"], batch["v"], batch["table"], batch["lens"],
                0.088, splits, out, pdl=pdl,
            )  # fmt: skip
            row.append(f"{timed_us(run):6.1f}")
        print(f"  splits={splits:2d} " + " / ".join(row), flush=True)


def bench_decode_fp8() -> None:
    """Decode attention over bf16 and fp8 (e4m3) pages of the same batch: us and the GB/s
    of the bytes each reads, per tile config (fp8 reads half the bytes, then converts)."""
    configs = [
        TileConfig(64, 4, 3, early_v=True),
        TileConfig(128, 4, 3, early_v=True),
        TileConfig(128, 8, 3, early_v=True),
        TileConfig(64, 8, 4, early_v=True),
        TileConfig(256, 8, 3, early_v=True),
    ]
    gen = torch.Generator().manual_seed(0)
    cases = {
        "8b bs1 ctx32768": [32768],
        "8b bs16 ctx4096": [4096] * 16,
        "8b bs256 ctx~576": torch.randint(512, 641, (256,), generator=gen).tolist(),
    }
    print("decode attention bf16 vs fp8 pages: us (GB/s of KV read)")
    for name, kv_lens in cases.items():
        batch = paged_batch(kv_lens, 8, 128)
        q = torch.randn(len(kv_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        splits = num_decode_splits(len(kv_lens), 8, 132)
        for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            k, v = batch["k"].to(kv_dtype), batch["v"].to(kv_dtype)
            kv_bytes = batch["kv_bytes"] * k.element_size() // 2
            row = []
            for config in configs:
                run = partial(
                    decode_attention,
                    q,
                    k,
                    v,
                    batch["table"],
                    batch["lens"],
                    0.088,
                    splits,
                    out,
                    config,
                )
                us = timed_us(run)
                row.append(f"{us:8.1f} ({kv_bytes / us / 1e3:5.0f})")
            print(f"  {name:18s} {str(kv_dtype)[6:]:14s} " + " ".join(row), flush=True)
    print("  configs:", [(c.block_n, c.num_warps, c.num_stages, c.early_v) for c in configs])


def bench_extend_fp8() -> None:
    """Extend attention over bf16 and fp8 (e4m3) pages: 16 x 512 causal, and one 2,048-token
    chunk over a 16k-token prefix (a long prompt's later chunk), per tile config."""
    configs = [
        TileConfig(32, 4, 3, block_m=64),
        TileConfig(64, 4, 3, block_m=64),
        TileConfig(64, 8, 3, block_m=128),
        TileConfig(128, 8, 3, block_m=128),
        TileConfig(64, 4, 4, block_m=64),
    ]
    print("extend attention bf16 vs fp8 pages: us (TF/s)")
    for name, num_seqs, q_len, kv_len in (
        ("16 x 512", 16, 512, 512),
        ("2k over 16k", 1, 2048, 18432),
    ):
        batch = paged_batch([kv_len] * num_seqs, 8, 128)
        q = torch.randn(num_seqs * q_len, 32, 128, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        starts = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32, device="cuda")
        tensors = PagedTensors(starts, batch["lens"], batch["table"], 0, q_len)
        flops = 4 * 32 * 128 * num_seqs * q_len * (kv_len - q_len / 2)
        for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            k, v = batch["k"].to(kv_dtype), batch["v"].to(kv_dtype)
            row = []
            for config in configs:
                run = partial(extend_attention, q, k, v, tensors, 0.088, out, config)
                us = timed_us(run)
                row.append(f"{us:8.1f} ({flops / us / 1e6:4.0f})")
            print(f"  {name:12s} {str(kv_dtype)[6:]:14s} " + " ".join(row), flush=True)
    print("  configs:", [(c.block_m, c.block_n, c.num_warps, c.num_stages) for c in configs])


def bench_extend() -> None:
    configs = [
        TileConfig(64, 8, 2, block_m=128),
        TileConfig(64, 8, 3, block_m=128),
        TileConfig(64, 4, 2, block_m=64),
        TileConfig(128, 8, 2, block_m=128),
        TileConfig(32, 4, 3, block_m=64),
    ]
    num_seqs, q_len = 16, 512
    batch = paged_batch([q_len] * num_seqs, 8, 128)
    q = torch.randn(num_seqs * q_len, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    starts = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32, device="cuda")
    tensors = PagedTensors(starts, batch["lens"], batch["table"], 0, q_len)
    flops = 4 * 32 * 128 * num_seqs * q_len * q_len / 2
    row = []
    for config in configs:
        run = partial(extend_attention, q, batch["k"], batch["v"], tensors, 0.088, out, config)
        us = timed_us(run)
        row.append(f"{us:8.1f} ({flops / us / 1e6:4.0f} TF/s)")
    print("extend attention 16 x 512 causal, 8b heads:", " ".join(row))
    print("  configs:", [(c.block_m, c.block_n, c.num_warps, c.num_stages) for c in configs])


def _each_weight(
    x: torch.Tensor, weights: list[torch.Tensor], config: GemvConfig | None, pdl: Pdl = NO_PDL
) -> None:
    for weight in weights:
        if config is None:
            torch.nn.functional.linear(x, weight)
        else:
            gemv(x, weight, None, config, pdl=pdl)


def bench_gemv() -> None:
    configs = [
        GemvConfig(16, 512, 4, 3),
        GemvConfig(16, 256, 4, 4),
        GemvConfig(32, 256, 4, 3),
        GemvConfig(8, 512, 4, 3),
        GemvConfig(8, 1024, 4, 2),
        GemvConfig(32, 512, 8, 3),
        GemvConfig(16, 1024, 8, 2),
        GemvConfig(64, 128, 4, 4),
    ]
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096)}
    shapes["down"] = (4096, 12288)
    print("batch-1 projection: us plain|PDL (GB/s with PDL); 4 weights rotated (not in L2)")
    for name, (n, k) in shapes.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nbytes = n * k * 2

        us = timed_us(partial(_each_weight, x, weights, None)) / 4
        row = [f"cublas {us:6.1f} ({nbytes / us / 1e3:5.0f})"]
        for config in configs:
            us = timed_us(partial(_each_weight, x, weights, config)) / 4
            pdl_us = timed_us(partial(_each_weight, x, weights, config, Pdl(True))) / 4
            row.append(f"{us:5.1f}|{pdl_us:5.1f} ({nbytes / pdl_us / 1e3:4.0f})")
        print(f"  {name:8s}", " ".join(row), flush=True)
    print("  configs:", [(c.block_n, c.block_k, c.num_warps, c.num_stages) for c in configs])


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), "triton", triton.__version__)
    parts = sys.argv[1].split(",") if len(sys.argv) > 1 else ["all"]
    benches = {
        "gemv": bench_gemv,
        "decode": bench_decode,
        "decode_bs1": bench_decode_batch1,
        "decode_fp8": bench_decode_fp8,
        "extend": bench_extend,
        "extend_fp8": bench_extend_fp8,
    }
    for name, bench in benches.items():
        if "all" in parts or name in parts:
            bench()
