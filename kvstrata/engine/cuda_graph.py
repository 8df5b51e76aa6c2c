"""CUDA graphs for decode steps: the only module that knows graphs exist. One graph per
bucketed batch size is captured over static input buffers; a decode step is padded up to
the nearest bucket and replayed. Padding rows write no KV (slot -1) and read none
(kv_len 0), so they never touch real pages."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstrata.attention.base import AttentionMetadata, BoundAttention, PagedTensors
from kvstrata.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from kvstrata.attention.base import AttentionBackend
    from kvstrata.config import EngineConfig
    from kvstrata.engine.runner import StepInputs

PAD_SLOT = -1  # the store kernel skips negative slots


def graph_batch_sizes(max_bs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every multiple of 16, up to and including
    `max_bs` (so padding wastes at most 15 rows above 16)."""
    if max_bs < 1:
        raise ValueError(f"max_bs must be >= 1, got {max_bs}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs]
    sizes += list(range(16, max_bs + 1, 16))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def padded_batch_size(sizes: list[int], num_seqs: int) -> int | None:
    """The smallest captured size that holds `num_seqs` rows, or None if none does."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


@dataclass
class PackedDecode:
    """A decode step's graph inputs on the host, padded to a captured batch size `bs`."""

    i64: torch.Tensor  # int64 [3, bs]: input ids, positions, slots (padding: 0, 0, PAD_SLOT)
    seq_lens: torch.Tensor  # int32 [bs]; padding rows 0 (they read no KV)
    page_table: torch.Tensor  # int32 [num_seqs, width]: a view of the persistent table


class DecodeInputPacker:
    """The host side of a graph replay: packs a decode step's inputs, keeping the page
    table between steps so that only entries that changed are written (a decoding request
    gains one page every page_size tokens; rows move only when the batch changes).

    Invariant after `pack`: row i holds the step's `page_tables[i]` in its first
    len(page_tables[i]) entries. Entries past that are stale pages of earlier steps,
    never read (the kernels stop at each row's kv_len). Relies on a page list only
    growing in place while a request holds it (`Request.page_ids`): any other change
    gives the request a new list, a new identity here, and its row is rewritten."""

    def __init__(self, max_bs: int, max_pages_per_seq: int) -> None:
        self.page_table_host = torch.zeros((max_bs, max_pages_per_seq), dtype=torch.int32)
        self._table = self.page_table_host.numpy()  # the same memory: cheap row writes
        # The page list each row mirrors (held, so identities stay unique) and how many
        # of its entries the row holds.
        self._row_pages: list[list[int] | None] = [None] * max_bs
        self._row_len: list[int] = [0] * max_bs

    def pack(self, step: StepInputs, bs: int) -> PackedDecode:
        num_seqs = step.num_seqs
        pad = bs - num_seqs
        i64 = torch.tensor(
            [
                step.input_ids + [0] * pad,
                step.positions + [0] * pad,
                step.slots + [PAD_SLOT] * pad,
            ],
            dtype=torch.long,
        )
        seq_lens = torch.tensor(step.kv_lens + [0] * pad, dtype=torch.int32)
        width = self.update_page_table(step.page_tables)
        return PackedDecode(i64, seq_lens, self.page_table_host[:num_seqs, :width])

    def update_page_table(self, page_tables: list[list[int]]) -> int:
        """Make rows [0, len(page_tables)) hold `page_tables`; returns the widest row."""
        row_pages, row_len = self._row_pages, self._row_len
        moved = [i for i, pages in enumerate(page_tables) if row_pages[i] is not pages]
        if moved:
            self._move_rows(page_tables, moved)
        for i, pages in enumerate(page_tables):
            if row_len[i] < len(pages):  # grown since the row was written
                self._table[i, row_len[i] : len(pages)] = pages[row_len[i] :]
                row_len[i] = len(pages)
        return max(map(len, page_tables))

    def _move_rows(self, page_tables: list[list[int]], rows: list[int]) -> None:
        """Point `rows` at their new page lists: copied from the row that held the list
        before (the batch changed around it), else written from scratch."""
        row_pages, row_len = self._row_pages, self._row_len
        old_row = {id(pages): i for i, pages in enumerate(row_pages) if pages is not None}
        old_len = list(row_len)
        dst, src = [], []
        for i in rows:
            pages = page_tables[i]
            j = old_row.get(id(pages))
            if j is not None:
                dst.append(i)
                src.append(j)
                row_len[i] = old_len[j]
            else:
                row_len[i] = 0  # `update_page_table` writes all of it
            row_pages[i] = pages
        if dst:
            # Fancy indexing reads every source row before any is overwritten.
            width = max(old_len[j] for j in src)
            self._table[dst, :width] = self._table[src, :width]


class CudaGraphRunner:
    """Captured decode steps of `model` through `backend` (which must be graph-safe)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        device: torch.device,
        max_bs: int,
        max_pages_per_seq: int,
    ) -> None:
        self.model = model
        self.backend = backend
        self.sizes = graph_batch_sizes(max_bs)
        max_bs = self.sizes[-1]
        # Static inputs: every graph reads views of these; `run` refills them in place.
        self._i64 = torch.zeros((3, max_bs), dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slots = self._i64[0], self._i64[1], self._i64[2]
        self.slots.fill_(PAD_SLOT)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.page_table = torch.zeros((max_bs, max_pages_per_seq), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.packer = DecodeInputPacker(max_bs, max_pages_per_seq)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._hidden: dict[int, torch.Tensor] = {}  # each graph's output buffer
        self._capture()

    def _bound(self, bs: int) -> BoundAttention:
        tensors = PagedTensors(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            page_table=self.page_table[:bs],
            num_decodes=bs,
            max_query_len=0,
        )
        # The lists describe the capture batch only; graph replays read the tensors.
        meta = AttentionMetadata(
            query_lens=[1] * bs,
            kv_lens=[0] * bs,
            page_tables=[[] for _ in range(bs)],
            slot_mapping=self.slots[:bs],
            tensors=tensors,
        )
        return BoundAttention(self.backend, meta)

    @torch.inference_mode()
    def _capture(self) -> None:
        # Largest first, all in one memory pool: smaller graphs reuse the larger ones'
        # intermediate buffers (graphs never run concurrently).
        pool = None
        # A capture stream of this device: torch's default one is made once per process,
        # on whichever device captured first, and would move a second GPU's capture there.
        stream = torch.cuda.Stream(self.input_ids.device)
        for bs in reversed(self.sizes):
            bound = self._bound(bs)
            # Warm-up outside the capture: compiles kernels, sets up cuBLAS workspaces.
            self.model(self.input_ids[:bs], self.positions[:bs], bound)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                hidden = self.model(self.input_ids[:bs], self.positions[:bs], bound)
            pool = graph.pool()
            self._graphs[bs] = graph
            self._hidden[bs] = hidden
        torch.cuda.synchronize()

    def can_run(self, step: StepInputs) -> bool:
        return (
            step.is_decode
            and padded_batch_size(self.sizes, step.num_seqs) is not None
            and max(len(pages) for pages in step.page_tables) <= self.page_table.shape[1]
        )

    def run(self, step: StepInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the graph for `step` (a decode step); fp32 logits [num_seqs, vocab].
        `input_ids` (on the device) replace the step's host token ids."""
        num_seqs = step.num_seqs
        bs = padded_batch_size(self.sizes, num_seqs)
        assert bs is not None
        host = self.packer.pack(step, bs)
        # Copies from pageable host memory: CUDA stages the source before returning, so
        # the packer may rewrite its buffers for the next step while this one is queued.
        self._i64[:, :bs].copy_(host.i64, non_blocking=True)
        if input_ids is not None:
            self.input_ids[:num_seqs].copy_(input_ids)
        self.seq_lens[:bs].copy_(host.seq_lens, non_blocking=True)
        width = host.page_table.shape[1]
        self.page_table[:num_seqs, :width].copy_(host.page_table, non_blocking=True)
        self._graphs[bs].replay()
        return self.model.compute_logits(self._hidden[bs][:num_seqs])


def make_cuda_graph_runner(
    config: EngineConfig,
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    device: torch.device,
    max_model_len: int,
) -> CudaGraphRunner | None:
    """Graphs for decode steps when the backend can be captured; None otherwise (e.g.
    `--attention-backend torch`, whose per-sequence host loop cannot be replayed)."""
    if not getattr(backend, "cuda_graph_safe", False):
        return None
    scheduler = config.scheduler
    max_bs = min(
        config.speed.cuda_graph_max_bs, scheduler.max_num_seqs, scheduler.max_num_batched_tokens
    )
    max_pages_per_seq = -(-max_model_len // config.pool.page_size)
    return CudaGraphRunner(model, backend, device, max_bs, max_pages_per_seq)
