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
EXTEND_CONFIG = TileConfig(block_n=32, num_warps=4, num_stages=3, block_m=64)
EXTEND_CONFIG_FP32 = TileConfig(block_n=32, num_warps=4, num_stages=2, block_m=32)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 runs must match the torch reference closely: no tf32 in the dots.
    return "ieee" if dtype == torch.float32 else "tf32"
