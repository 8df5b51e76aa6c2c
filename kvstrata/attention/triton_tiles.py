"""Launch shapes of the paged attention kernels: `TileConfig` (bench/kernels.py sweeps it),
the tuned defaults of decode and extend, and the dot precision each dtype runs at."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of an attention kernel (bench/kernels.py sweeps these)."""

    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    block_m: int = 0  # extend: query rows per program
    early_v: bool = False  # decode: issue the V load before the softmax


# Chosen by bench/kernels.py on an H200 (docs/results.md): decode reads KV at ~4 TB/s
# with 3 stages and V issued early; 64 x 32 extend tiles beat 128 x 64 by ~20%.
DECODE_CONFIG = TileConfig(block_n=64, num_warps=4, num_stages=3, early_v=True)
# fp8 pages (bench/kernels.py decode_fp8, H200): 128-key tiles, as each row is half the
# bytes: 35 us at bs1 x 32k (bf16 pages 44 us), 62 us at bs16 x 4k (70), 147 at bs256 (152).
DECODE_CONFIG_FP8 = TileConfig(block_n=128, num_warps=4, num_stages=3, early_v=True)
EXTEND_CONFIG = TileConfig(block_n=32, num_warps=4, num_stages=3, block_m=64)
EXTEND_CONFIG_FP32 = TileConfig(block_n=32, num_warps=4, num_stages=2, block_m=32)
# fp8 pages (bench/kernels.py extend_fp8, H200): 128 x 128 tiles, 8 warps: a 2k chunk over
# a 16k prefix 2,353 us (bf16 pages, 64 x 32: 2,683; fp8 at 64 x 32: 3,239), 16 x 512
# causal 228 us (197; 237).
EXTEND_CONFIG_FP8 = TileConfig(block_n=128, num_warps=8, num_stages=3, block_m=128)


def half_dots(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """bf16 queries over fp8 pages dot in fp16: the pages convert to fp16 in one native
    instruction per pair of values (to bf16 through fp32: the decode kernel measured 1.3
    TB/s of fp8 bytes against 3 TB/s of bf16 ones), and fp16 holds bf16 queries (clamped
    to its range) and softmax weights with more mantissa. fp32 queries keep fp32 dots."""
    return k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and q.dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 runs must match the torch reference closely: no tf32 in the dots.
    return "ieee" if dtype == torch.float32 else "tf32"
