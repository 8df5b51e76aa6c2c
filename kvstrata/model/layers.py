"""Model building blocks for the Llama family: RMSNorm, rotary embedding (with the
`rope_scaling` variants of Hugging Face configs), the SiLU-gated MLP, the vocab embedding
and the LM head, plus `ModelOps`: the seam through which the elementwise work (norms,
RoPE, SiLU) can run as fused kernels. Plain torch modules; no global state."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.model.tp import SINGLE, Collectives

if TYPE_CHECKING:  # the attention backend's type only: attention imports the KV pool
    from kvstrata.attention.base import KVDestination

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight * x / rms(x) over the last axis. The statistics are computed in fp32 and
    the normalised value is cast back to the input dtype before the weight multiplies it
    (the order the reference checkpoints were trained with, which matters in bf16)."""
    x_fp32 = x.float()
    variance = x_fp32.pow(2).mean(dim=-1, keepdim=True)
    normed = x_fp32 * torch.rsqrt(variance + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual update and the next block's input: (x + delta, rms_norm(x + delta))."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (Qwen3: weights given) and then RoPE on both."""
    if q_weight is not None and k_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: KVDestination,
) -> torch.Tensor:
    """`qk_norm_rope`, then k and v written to their slots of the KV cache (negative
    slots skipped); returns q. The reference for fused sets that do both in one pass."""
    q, k = qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)
    slots = kv_cache.slot_mapping
    keep = slots >= 0
    for cache, new in ((kv_cache.k_cache, k), (kv_cache.v_cache, v)):
        cache.view(-1, *cache.shape[2:])[slots[keep]] = new[keep].to(cache.dtype)
    return q


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def silu_mul_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The MLP's down projection of silu(gate) * up (a fused set may skip the product's
    round trip through memory)."""
    return F.linear(silu_mul(gate, up), weight)


@dataclass(frozen=True)
class ModelOps:
    """The kernels a decoder layer calls besides attention: its projections (`linear`,
    F.linear's signature) and elementwise work (signatures as the functions above).
    TORCH_OPS is the reference and the only set on CPU; a fused set
    (`kvstrata.model.triton_ops.make_triton_ops`) must match it to floating-point tolerance.
    Installed on a built model with `LlamaForCausalLM.set_ops`."""

    name: str
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    qk_norm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    silu_mul_linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    # None: k/v go to the attention backend, which stores them (the reference path).
    qk_norm_rope_store: Callable[..., torch.Tensor] | None = None


TORCH_OPS = ModelOps(
    "torch", F.linear, rms_norm, add_rms_norm, qk_norm_rope, silu_mul, silu_mul_linear
)


class RMSNorm(nn.Module):
    """y = weight * x / rms(x); see `rms_norm` for the order of operations."""

    ops: ModelOps = TORCH_OPS

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


@dataclass(frozen=True)
class RopeScaling:
    """A `rope_scaling` / `rope_parameters` entry of a Hugging Face config.

    `factor` is the context extension ratio; the llama3 and yarn variants also read
    `original_max_position_embeddings` (the pre-training context length)."""

    rope_type: str
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: cos/sin multiplier; None = derived
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dims

    @staticmethod
    def from_hf(params: dict[str, Any] | None) -> RopeScaling | None:
        """Parse a config dict; None (plain RoPE) for a missing or `default` entry."""
        if not params:
            return None
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        factor = params.get("factor")
        if factor is None:
            raise ValueError(f"rope_scaling type {rope_type!r} needs a 'factor'")
        original_len = params.get("original_max_position_embeddings")
        if rope_type in ("llama3", "yarn") and original_len is None:
            raise ValueError(
                f"rope_scaling type {rope_type!r} needs 'original_max_position_embeddings'"
            )
        return RopeScaling(
            rope_type=rope_type,
            factor=float(factor),
            original_max_position_embeddings=original_len,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
        )


def rope_inv_freq(
    head_dim: int, rope_theta: float, scaling: RopeScaling | None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (fp32, [head_dim // 2]) and the cos/sin multiplier.

    Computed in fp32 on purpose: checkpoints were trained against fp32 frequencies, and
    matching them bit for bit keeps long positions aligned with the reference."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    if scaling is None:
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        # Dividing frequencies by `factor` is dividing positions by `factor`.
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, rope_theta, scaling)
    raise ValueError(f"unsupported rope_scaling type {scaling.rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Wavelengths longer than original_len / low_freq_factor are interpolated (divided by
    # factor), shorter than original_len / high_freq_factor kept, and the band between is
    # a linear blend in original_len / wavelength.
    assert scaling.original_max_position_embeddings is not None
    original_len = scaling.original_max_position_embeddings
    low_freq_wavelen = original_len / scaling.low_freq_factor
    high_freq_wavelen = original_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    blend = (original_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - blend) * scaled / scaling.factor + blend * scaled
    is_mid_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_mid_band, blended, scaled)


def _yarn_inv_freq(
    head_dim: int, rope_theta: float, scaling: RopeScaling
) -> tuple[torch.Tensor, float]:
    # YaRN: dims that rotate fewer than beta_slow times over the original context are
    # interpolated, dims rotating more than beta_fast times are kept, with a linear ramp
    # between; cos/sin are multiplied by an attention factor that grows with log(factor).
    assert scaling.original_max_position_embeddings is not None
    original_len = scaling.original_max_position_embeddings
    factor = scaling.factor

    def mscale_for(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = mscale_for(factor, scaling.mscale) / mscale_for(
                factor, scaling.mscale_all_dim
            )
        else:
            attention_factor = mscale_for(factor)

    def dim_for_rotations(num_rotations: float) -> float:
        return (head_dim * math.log(original_len / (num_rotations * 2 * math.pi))) / (
            2 * math.log(rope_theta)
        )

    low, high = dim_for_rotations(scaling.beta_fast), dim_for_rotations(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # keep the ramp finite

    freqs = rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_weight = 1 - ramp  # 1 = keep the original frequency, 0 = interpolate
    inv_freq = (1.0 / (factor * freqs)) * (1 - keep_weight) + (1.0 / freqs) * keep_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """RoPE in the half-split layout: dims [0, d/2) pair with [d/2, d).

    `inv_freq` is a non-persistent fp32 buffer created on the CPU even under a meta-device
    context, so a model built on `meta` for loading still has real frequencies; move the
    model with `.to(device)`, never `.to(dtype)` (that would round the frequencies)."""

    inv_freq: torch.Tensor  # the buffer (registered below)

    def __init__(self, head_dim: int, rope_theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        with torch.device("cpu"):  # real values even when the model is built on meta
            inv_freq, attention_factor = rope_inv_freq(head_dim, rope_theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_factor = attention_factor

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos and sin for int64 `positions` [num_tokens] -> [num_tokens, head_dim] each.
        Computed once per forward pass and shared by every layer."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [num_tokens, num_heads, head_dim] by the per-token angles in cos/sin."""
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin


def merge_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the given Linears' outputs side by side (one GEMM
    instead of several; the same products, up to the GEMM's summation order)."""
    weight = torch.cat([linear.weight for linear in linears])
    has_bias = linears[0].bias is not None
    merged = nn.Linear(
        weight.shape[1], weight.shape[0], bias=has_bias, device=weight.device, dtype=weight.dtype
    )
    merged.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        bias = torch.cat([linear.bias for linear in linears])
        merged.bias = nn.Parameter(bias, requires_grad=False)
    return merged


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases. Under tensor parallelism gate/up hold this
    worker's columns and down its rows: the partial sums add up over the group."""

    ops: ModelOps = TORCH_OPS
    tp: Collectives = SINGLE

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # [gate | up], see merge_projections

    def merge_projections(self) -> None:
        """Replace gate and up by one [gate | up] projection (after loading weights)."""
        self.gate_up_proj = merge_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.ops.linear
        if self.gate_up_proj is not None:
            gate_up = linear(x, self.gate_up_proj.weight, None)
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
        else:
            gate, up = linear(x, self.gate_proj.weight, None), linear(x, self.up_proj.weight, None)
        return self.tp.all_reduce(self.ops.silu_mul_linear(gate, up, self.down_proj.weight))


class VocabEmbedding(nn.Module):
    """Token id -> embedding row; `weight` is [vocab_size, hidden_size]. Under tensor
    parallelism it holds rows [vocab_start, vocab_start + vocab_size) of the vocabulary:
    other ids give zeros here and their row on the worker that holds it."""

    tp: Collectives = SINGLE
    vocab_start: int = 0

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        here = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(here, local, 0), self.weight)
        return self.tp.all_reduce(rows * here.unsqueeze(-1).to(rows.dtype))


class LMHead(nn.Module):
    """Hidden states -> fp32 logits with its own [vocab_size, hidden_size] weight. Tied
    models have no LMHead and call `project_to_vocab` with the embedding weight."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return project_to_vocab(hidden, self.weight)


def project_to_vocab(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[n, hidden] x [vocab, hidden] -> fp32 logits [n, vocab]. The matmul runs in the
    model dtype (as the reference does); only the result is upcast for sampling."""
    return F.linear(hidden, weight).float()
