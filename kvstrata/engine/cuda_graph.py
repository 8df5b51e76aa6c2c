"""CUDA graphs for decode steps: the only module that knows graphs exist. One graph per
bucketed batch size is captured over static input buffers; a decode step is padded up to
the nearest bucket and replayed. Padding rows write no KV (slot -1) and read none
(kv_len 0), so they never touch real pages."""

from __future__ import annotations

import bisect
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
        pad = bs - num_seqs
        host_i64 = torch.tensor(
            [
                step.input_ids + [0] * pad,
                step.positions + [0] * pad,
                step.slots + [PAD_SLOT] * pad,
            ],
            dtype=torch.long,
        )
        self._i64[:, :bs].copy_(host_i64, non_blocking=True)
        if input_ids is not None:
            self.input_ids[:num_seqs].copy_(input_ids)
        self.seq_lens[:bs].copy_(
            torch.tensor(step.kv_lens + [0] * pad, dtype=torch.int32), non_blocking=True
        )
        # Rows past each sequence's pages (and padding rows) are never read: the kernels
        # stop at kv_len, so stale entries from earlier steps are harmless.
        width = max(len(pages) for pages in step.page_tables)
        flat: list[int] = []  # one flat list: far cheaper to convert than a nested one
        for pages in step.page_tables:
            flat += pages
            flat += [0] * (width - len(pages))
        table = torch.tensor(flat, dtype=torch.int32).view(num_seqs, width)
        self.page_table[:num_seqs, :width].copy_(table, non_blocking=True)
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
    max_bs = min(config.cuda_graph_max_bs, config.max_num_seqs, config.max_num_batched_tokens)
    max_pages_per_seq = -(-max_model_len // config.page_size)
    return CudaGraphRunner(model, backend, device, max_bs, max_pages_per_seq)
