"""Random paged-attention cases for the kernel parity tests: a batch layout, random
q/k/v, and two identical pools (one per backend) whose pages hold random cached KV."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.attention.base import AttentionMetadata, PagedTensors
from kvstrata.kvcache.pages import KVPool


@dataclass
class PagedCase:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    meta: AttentionMetadata
    pools: tuple[KVPool, KVPool]
    scale: float


def make_case(
    query_lens: list[int],
    kv_lens: list[int],
    *,
    page_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> PagedCase:
    """Sequence i computes tokens [kv_lens[i] - query_lens[i], kv_lens[i]); its pages are
    drawn from a shuffled pool (two spare pages stay unused, so stray writes show)."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-kv_len // page_size) for kv_len in kv_lens) + 2
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables, slots = [], []
    for query_len, kv_len in zip(query_lens, kv_lens):
        num_seq_pages = -(-kv_len // page_size)
        pages, order = order[:num_seq_pages], order[num_seq_pages:]
        tables.append(pages)
        for pos in range(kv_len - query_len, kv_len):
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
    num_tokens = sum(query_lens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype).to(device)

    q = rand(num_tokens, num_q_heads, head_dim)
    k = rand(num_tokens, num_kv_heads, head_dim)
    v = rand(num_tokens, num_kv_heads, head_dim)
    width = max(len(t) for t in tables)
    page_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    tensors = PagedTensors(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        page_table=page_table.to(device),
        num_decodes=num_decodes,
        max_query_len=max(query_lens[num_decodes:], default=0),
    )
    meta = AttentionMetadata(
        query_lens=list(query_lens),
        kv_lens=list(kv_lens),
        page_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        tensors=tensors,
    )
    cached_k = rand(num_pages, page_size, num_kv_heads, head_dim)
    cached_v = rand(num_pages, page_size, num_kv_heads, head_dim)
    pools = []
    for _ in range(2):
        pool = KVPool(num_pages, page_size, 1, num_kv_heads, head_dim, dtype, device)
        pool.k_cache[0].copy_(cached_k)
        pool.v_cache[0].copy_(cached_v)
        pools.append(pool)
    return PagedCase(q, k, v, meta, (pools[0], pools[1]), head_dim**-0.5)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())
