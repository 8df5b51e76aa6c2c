"""Attention backends over paged KV, and `make_attention_backend`: the one place that
picks one for a device."""

from __future__ import annotations

import torch

from kvstrata.attention.base import AttentionBackend
from kvstrata.config import ConfigError
from kvstrata.kvcache.pages import KVPool

ATTENTION_BACKENDS = ("auto", "torch", "triton")


def make_attention_backend(
    name: str, pool: KVPool, device: torch.device, disable_pdl: bool = False
) -> AttentionBackend:
    """`auto`: triton on CUDA, torch elsewhere. `triton` without CUDA is refused; its
    kernels use programmatic dependent launch where the device has it, unless
    `disable_pdl`."""
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}"
        )
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        if device.type != "cuda":
            raise ConfigError(
                f"--attention-backend triton needs a CUDA device (this engine runs on "
                f"{device.type}); use --attention-backend torch or auto"
            )
        from kvstrata.attention.triton_paged import TritonPagedAttention
        from kvstrata.pdl import pdl_for

        return TritonPagedAttention(pool, pdl_for(device, disable_pdl))
    from kvstrata.attention.torch_ref import TorchAttention

    return TorchAttention(pool)
