"""The `torch` attention backend: gathers each sequence's pages and calls SDPA.
Runs on any device; the reference that faster backends are checked against (for an fp8
pool too: `stored` is what every store writes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstrata.attention.base import AttentionMetadata
from kvstrata.kvcache.kv_scales import fp8_max, is_fp8
from kvstrata.kvcache.pages import KVPool


def stored(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """x as `cache` holds it: an fp8 cache, x / scale saturated to its range (in fp32);
    any other, x cast. Reading it back into x's dtype and times `scale` undoes it."""
    if not is_fp8(cache.dtype):
        return x.to(cache.dtype)
    top = fp8_max(cache.dtype)
    return (x.float() * (1.0 / scale)).clamp(-top, top).to(cache.dtype)


class TorchAttention:
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        scale: float,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert k is not None and v is not None, "the torch backend stores K/V itself"
        k_pages = self.pool.k_cache[layer_id]
        v_pages = self.pool.v_cache[layer_id]
        k_scale, v_scale = self.pool.scales.k[layer_id], self.pool.scales.v[layer_id]
        num_kv_heads, head_dim = k_pages.shape[2], k_pages.shape[3]
        k_pages.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = stored(k, k_pages, k_scale)
        v_pages.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = stored(v, v_pages, v_scale)

        group = q.shape[1] // num_kv_heads
        out = torch.empty_like(q)
        q_start = 0
        for query_len, kv_len, pages in zip(meta.query_lens, meta.kv_lens, meta.page_tables):
            page_index = torch.tensor(pages, dtype=torch.long, device=q.device)
            keys = k_pages[page_index].flatten(0, 1)[:kv_len].to(q.dtype)
            values = v_pages[page_index].flatten(0, 1)[:kv_len].to(q.dtype)
            if group > 1:
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
            # Query j sits at absolute position kv_len - query_len + j and sees keys <= it.
            q_pos = torch.arange(kv_len - query_len, kv_len, device=q.device)
            mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
            seq_out = F.scaled_dot_product_attention(
                q[q_start : q_start + query_len].transpose(0, 1),
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=mask,
                scale=scale * k_scale,
            )
            out[q_start : q_start + query_len] = seq_out.transpose(0, 1) * v_scale
            q_start += query_len
        return out
