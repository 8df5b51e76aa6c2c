"""The `triton` attention backend (GPU; TRITON_INTERPRET=1 runs it on CPU for tests):
decodes through `triton_decode`'s split-K kernel, the rest through `triton_extend`, KV
stored by `triton_store` (an fp8 pool: quantized there, dequantized in the attention
kernels with the pool's per-layer scales). Reads `meta.tensors`, never syncs: CUDA-graph
capturable."""

from __future__ import annotations

import torch

from kvstrata.attention.base import AttentionMetadata, KVDestination
from kvstrata.attention.triton_decode import decode_attention
from kvstrata.attention.triton_extend import extend_attention
from kvstrata.attention.triton_store import quant_max, store_kv
from kvstrata.kvcache.pages import KVPool
from kvstrata.pdl import NO_PDL, Pdl

MAX_SPLITS = 32  # split-K fan-out cap for decode; powers of two only (reduce block size)


def num_decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Split-K fan-out: enough programs for about two waves over the SMs, a power of two
    in [1, MAX_SPLITS]. Depends on the batch shape only (never on KV lengths), so a
    CUDA graph captured for a batch size stays valid for any lengths."""
    wanted = -(-2 * num_sms // max(1, num_seqs * num_kv_heads))
    splits = 1
    while splits < wanted and splits < MAX_SPLITS:
        splits *= 2
    return splits


class TritonPagedAttention:
    """Paged attention kernels over `pool`. Sequences [0, num_decodes) of a step (one
    query token each) take the split-K decode kernel; the rest take the extend kernel.
    `pdl`: launch them with programmatic dependent launch."""

    needs_tensors = True  # reads meta.tensors (see AttentionBackend)
    cuda_graph_safe = True  # no host syncs, no host data: capturable
    accepts_stored_kv = True  # k = v = None: the caller wrote them to kv_destination

    def __init__(self, pool: KVPool, pdl: Pdl = NO_PDL) -> None:
        self.pool = pool
        self.pdl = pdl
        device = pool.k_cache[0].device
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 132
        )

    def kv_destination(self, layer_id: int, meta: AttentionMetadata) -> KVDestination:
        scales = self.pool.scales
        return KVDestination(
            self.pool.k_cache[layer_id],
            self.pool.v_cache[layer_id],
            meta.slot_mapping,
            scales.k[layer_id],
            scales.v[layer_id],
            quant_max(self.pool.k_cache[layer_id]),
        )

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        scale: float,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tensors = meta.tensors
        if tensors is None:
            raise ValueError("the triton backend needs meta.tensors (built by the runner)")
        k_cache = self.pool.k_cache[layer_id]
        v_cache = self.pool.v_cache[layer_id]
        k_scale, v_scale = self.pool.scales.k[layer_id], self.pool.scales.v[layer_id]
        if k is not None and v is not None:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping, self.pdl, k_scale, v_scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_decodes = tensors.num_decodes
        num_seqs = tensors.seq_lens.shape[0]
        if num_decodes > 0:
            splits = num_decode_splits(num_decodes, k_cache.shape[2], self.num_sms)
            decode_attention(
                q[:num_decodes],
                k_cache,
                v_cache,
                tensors.page_table[:num_decodes],
                tensors.seq_lens[:num_decodes],
                scale,
                splits,
                out[:num_decodes],
                pdl=self.pdl,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        if num_decodes < num_seqs:
            extend_attention(
                q, k_cache, v_cache, tensors, scale, out, None, self.pdl, k_scale, v_scale
            )
        return out
