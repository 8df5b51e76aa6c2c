"""Fused Triton kernels for RMSNorm (+ the residual add) and SiLU-gate * up, and
`make_triton_ops`: the CUDA `ModelOps` set, with q/k norm + RoPE from `triton_rope` and
single-row projections on `triton_gemv`, each rounding where the torch reference rounds."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvstrata.model.layers import ModelOps
from kvstrata.model.triton_gemv import GEMV_MAX_ROWS, gemv, gemv_config
from kvstrata.model.triton_rope import fused_qk_norm_rope, fused_qk_norm_rope_store
from kvstrata.pdl import NO_PDL, Pdl, wait_for_inputs


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    delta_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_delta,
    stride_out,
    stride_sum,
    dim,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per row. HAS_DELTA: x <- x + delta (rounded, stored to sum_ptr) first.
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / dim + eps)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask
    )


@triton.jit
def _silu_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    stride_g,
    stride_u,
    stride_o,
    dim,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (row, column block): silu(gate) rounded to the activation dtype, times up.
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < dim
    gate = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def fused_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pdl: Pdl = NO_PDL
) -> torch.Tensor:
    """F.linear, with single-row inputs (batch-1 decode) through the GEMV kernel. The
    row count is a host-side shape, so the choice costs no sync and is fixed per graph."""
    if x.dim() == 2 and x.shape[0] == GEMV_MAX_ROWS:
        return gemv(x, weight, bias, gemv_config(weight.shape[1]), pdl=pdl)
    return F.linear(x, weight, bias)


def fused_silu_mul_linear(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, pdl: Pdl = NO_PDL
) -> torch.Tensor:
    """down(silu(gate) * up): one GEMV for a single row (batch-1 decode), else the fused
    SiLU-mul then the projection."""
    if gate.dim() == 2 and gate.shape[0] == GEMV_MAX_ROWS:
        return gemv(gate, weight, None, gemv_config(weight.shape[1]), up=up, pdl=pdl)
    return fused_linear(fused_silu_mul(gate, up, pdl), weight, None, pdl)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last_dim] with a unit stride on the last axis."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm_warps(block: int) -> int:
    return 8 if block >= 4096 else 4 if block >= 1024 else 1


def fused_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: Pdl = NO_PDL
) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(x2.shape[1])
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            x2,
            weight,
            out,
            out,
            x2.stride(0),
            0,
            out.stride(0),
            0,
            x2.shape[1],
            eps,
            HAS_DELTA=False,
            BLOCK=block,
            PDL=pdl.enabled,
            num_warps=_norm_warps(block),
            **pdl.options(),
        )
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, pdl: Pdl = NO_PDL
) -> tuple[torch.Tensor, torch.Tensor]:
    x2, d2 = _rows(x), _rows(delta)
    summed = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    out = torch.empty_like(summed)
    if x2.shape[0]:
        block = triton.next_power_of_2(x2.shape[1])
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            d2,
            weight,
            out,
            summed,
            x2.stride(0),
            d2.stride(0),
            out.stride(0),
            summed.stride(0),
            x2.shape[1],
            eps,
            HAS_DELTA=True,
            BLOCK=block,
            PDL=pdl.enabled,
            num_warps=_norm_warps(block),
            **pdl.options(),
        )
    return summed.view(x.shape), out.view(x.shape)


def fused_silu_mul(gate: torch.Tensor, up: torch.Tensor, pdl: Pdl = NO_PDL) -> torch.Tensor:
    g2, u2 = _rows(gate), _rows(up)
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    if g2.shape[0]:
        block = 1024
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(g2.shape[1], block))](
            g2,
            u2,
            out,
            g2.stride(0),
            u2.stride(0),
            out.stride(0),
            g2.shape[1],
            BLOCK=block,
            PDL=pdl.enabled,
            num_warps=4,
            **pdl.options(),
        )
    return out.view(gate.shape)


def make_triton_ops(pdl: Pdl = NO_PDL) -> ModelOps:
    """The fused set; `pdl`: launch every kernel with programmatic dependent launch."""
    return ModelOps(
        "triton",
        partial(fused_linear, pdl=pdl),
        partial(fused_rms_norm, pdl=pdl),
        partial(fused_add_rms_norm, pdl=pdl),
        partial(fused_qk_norm_rope, pdl=pdl),
        partial(fused_silu_mul, pdl=pdl),
        partial(fused_silu_mul_linear, pdl=pdl),
        partial(fused_qk_norm_rope_store, pdl=pdl),
    )


TRITON_OPS = make_triton_ops()
