"""The `torch` attention backend: gathers each sequence's pages and calls SDPA.
Runs on any device; the reference that faster backends are checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstrata.attention.base import AttentionMetadata
from kvstrata.kvcache.pages import KVPool


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
        num_kv_heads, head_dim = k_pages.shape[2], k_pages.shape[3]
        k_pages.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = k.to(k_pages.dtype)
        v_pages.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = v.to(v_pages.dtype)

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
                scale=scale,
            )
            out[q_start : q_start + query_len] = seq_out.transpose(0, 1)
            q_start += query_len
        return out
