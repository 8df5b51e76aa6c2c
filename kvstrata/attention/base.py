"""The attention backend contract and the per-step metadata it reads.

A backend writes the step's new K/V into the L1 pool at `slot_mapping` and attends each
sequence's queries over its pages. Backends may differ only by floating-point rounding;
the `torch` backend is the reference every other backend is tested against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

import torch


@dataclass(frozen=True)
class PagedTensors:
    """The step's layout as device tensors, for GPU backends; built once per step by the
    runner (or held static by a CUDA graph), never per layer. `num_decodes` counts the
    leading sequences that have exactly one query token each (the scheduler puts decodes
    first; any sequence after the first longer one counts as an extend)."""

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: seq i's tokens are [s[i], s[i+1])
    seq_lens: torch.Tensor  # int32 [num_seqs]: kv_lens
    page_table: torch.Tensor  # int32 [num_seqs, width]: row i valid for its first pages
    num_decodes: int  # host int
    max_query_len: int  # host int: longest query of sequences [num_decodes, num_seqs)


@dataclass
class AttentionMetadata:
    """Layout of one forward pass. Sequences are concatenated along the token axis.

    For sequence i the step computes tokens [kv_lens[i] - query_lens[i], kv_lens[i]);
    `page_tables[i]` lists the L1 pages holding tokens [0, kv_lens[i]) in order, and
    `slot_mapping[t]` = page_id * page_size + offset is where token t's K/V is written.
    """

    query_lens: list[int]
    kv_lens: list[int]
    page_tables: list[list[int]]
    slot_mapping: torch.Tensor  # int64 [num_tokens], on the pool's device
    tensors: PagedTensors | None = None  # set when the backend `needs_tensors`

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


@dataclass(frozen=True)
class KVDestination:
    """Where one layer's new K/V of a step go: token t at `slot_mapping[t]` of the
    caches ([num_pages, page_size, num_kv_heads, head_dim]); negative slots are skipped.
    An fp8 cache holds K / k_scale and V / v_scale, saturated."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0
    quant_max: float = 0.0  # an fp8 cache: its dtype's largest value; else 0 (no scaling)


class AttentionBackend(Protocol):
    """Paged attention for one rank's L1 pool. Called once per layer per step.

    Optional class attributes, read with getattr (default False): `needs_tensors` (the
    runner must fill `meta.tensors`), `cuda_graph_safe` (forward reads no host data
    and never syncs, so a decode step through it can be captured in a CUDA graph), and
    `accepts_stored_kv` (forward takes k = v = None when the caller already wrote the
    step's K/V to `kv_destination`, e.g. from a fused RoPE kernel)."""

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
        k: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None: stored
        v: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None: stored
        scale: float,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
        ...


class StoresKVOutside(AttentionBackend, Protocol):
    """A backend with `accepts_stored_kv`: it says where a layer's new K/V go, so that the
    caller can write them there itself (a fused kernel) and pass k = v = None."""

    def kv_destination(self, layer_id: int, meta: AttentionMetadata) -> KVDestination: ...


@dataclass(frozen=True)
class BoundAttention:
    """A backend bound to one step's metadata: what a model's attention layers call."""

    backend: AttentionBackend
    meta: AttentionMetadata

    def __call__(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        return self.backend.forward(layer_id, q, k, v, scale, self.meta)

    def kv_destination(self, layer_id: int) -> KVDestination | None:
        """Where the caller may write this layer's K/V itself (then pass k = v = None),
        or None if the backend stores them."""
        if not getattr(self.backend, "accepts_stored_kv", False):
            return None  # a class attribute: read per layer, cheaper than a Protocol check
        return cast(StoresKVOutside, self.backend).kv_destination(layer_id, self.meta)
