"""The bandwidth-bound GEMV for single-row projections (batch-1 decode), optionally with
SiLU(gate) * up made in it for the down projection. Under PDL its first weight tile loads
while the kernel before it drains (no kernel of a step writes weights)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvstrata.pdl import NO_PDL, Pdl, wait_for_inputs


@triton.jit
def _input_block(x_ptr, up_ptr, offs_k, k_mask, SILU_MUL: tl.constexpr):
    # One K block of the GEMV's input in fp32. SILU_MUL: silu(x) * up, with
    # `_silu_mul_kernel`'s roundings, so the result is bit-identical to the pair.
    x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
    if SILU_MUL:
        up = tl.load(up_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        g = x.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(x.dtype).to(tl.float32)
        x = (act * up).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,
    up_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    # out[n] = sum_k x[k] * w[n, k] (+ bias[n]) for BLOCK_N rows of w: one pass over the
    # weight, fp32 products summed per lane across K and reduced once at the end. The
    # first weight tile loads before the wait: under PDL, while the kernel before drains.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    w = tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    wait_for_inputs(PDL)
    acc = w.to(tl.float32) * _input_block(x_ptr, up_ptr, offs_k, k_mask, SILU_MUL)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = _input_block(x_ptr, up_ptr, offs_k, k_mask, SILU_MUL)
        acc += w.to(tl.float32) * x[None, :]
    out = tl.sum(acc, 1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Chosen by bench/kernels.py on an H200 with PDL (docs/results.md): 3.7-4.4 TB/s on
# qwen3-8b projections, against cuBLAS's 2.5-4.2 (which also adds split-K reduce kernels).
GEMV_CONFIG = GemvConfig(block_n=8, block_k=1024, num_warps=4, num_stages=2)
GEMV_CONFIG_LONG_K = GemvConfig(block_n=16, block_k=1024, num_warps=8, num_stages=2)
LONG_K = 8192
GEMV_MAX_ROWS = 1  # the GEMV serves single-row inputs; larger batches go to cuBLAS


def gemv_config(k: int) -> GemvConfig:
    return GEMV_CONFIG_LONG_K if k >= LONG_K else GEMV_CONFIG


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig,
    up: torch.Tensor | None = None,
    pdl: Pdl = NO_PDL,
) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias) -> [1, N] in x's dtype; with `up` ([1, K]),
    silu(x) * up takes x's place."""
    n, k = weight.shape
    assert weight.stride(1) == 1
    x1 = _unit_stride(x.reshape(k))
    up1 = _unit_stride(up.reshape(k)) if up is not None else x1
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x1,
        up1,
        weight,
        bias if bias is not None else weight,
        out,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        SILU_MUL=up is not None,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        PDL=pdl.enabled,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl.options(),
    )
    return out


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(0) == 1 else x.contiguous()
