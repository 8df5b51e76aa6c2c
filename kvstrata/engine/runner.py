"""Turns a scheduled batch into model inputs (token ids, positions, attention metadata),
runs the model and returns the logits of the rows that sample a token. Owns the seams of
the step's speed tricks: fused elementwise kernels and CUDA-graph replay of decode steps
(`build_runner` picks them; each has an off switch in EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstrata.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    BoundAttention,
    PagedTensors,
)
from kvstrata.core import Batch, Request, ScheduledRequest
from kvstrata.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from kvstrata.config import EngineConfig
    from kvstrata.engine.cuda_graph import CudaGraphRunner


@dataclass
class StepInputs:
    """One step's model inputs on the host, built once from the batch. Sequences are
    concatenated along the token axis in batch order."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # page_id * page_size + offset where each token's K/V goes
    query_lens: list[int]
    kv_lens: list[int]
    # Pages holding tokens [0, kv_lens[i]) of sequence i. May alias a request's own
    # page list: read-only, and valid only until the scheduler runs again.
    page_tables: list[list[int]]
    sample_rows: list[int]  # token rows whose logits are sampled, in batch order

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_decodes(self) -> int:
        """Leading sequences with exactly one query token."""
        count = 0
        for query_len in self.query_lens:
            if query_len != 1:
                break
            count += 1
        return count

    @property
    def is_decode(self) -> bool:
        """Every sequence computes one token and samples from it."""
        return len(self.input_ids) == self.num_seqs == len(self.sample_rows)


@dataclass(frozen=True)
class PromptRows:
    """Hidden states of prompt positions [first_pos, first_pos + len(hidden)) of a request
    that asked for its prompt's logprobs (position p predicts prompt token p + 1)."""

    request: Request
    first_pos: int
    hidden: torch.Tensor  # [num_rows, hidden_size]


def prompt_rows_wanted(batch: Batch) -> list[tuple[Request, int, int, int]]:
    """(request, first row in the step, first position, number of rows) of the prompt
    positions whose logprobs are still missing: each position once, across chunks and
    preemptions (`Request.prompt_logprobs` grows in position order)."""
    wanted = []
    row = 0
    for item in batch.items:
        req = item.request
        if req.params.prompt_logprobs is not None:
            low = max(item.start, len(req.prompt_logprobs))
            high = min(item.end, req.prompt_len - 1)
            if low < high:
                wanted.append((req, row + low - item.start, low, high - low))
        row += item.num_new_tokens
    return wanted


def build_step_inputs(batch: Batch, page_size: int) -> StepInputs:
    items = batch.items
    # The scheduler puts decodes first: build that run in one go, then the rest row by
    # row (a decode further on takes the general path, which gives it the same row).
    num_decodes = 0
    for item in items:
        if item.num_new_tokens != 1 or not item.samples:
            break
        num_decodes += 1
    decodes = items[:num_decodes]
    token_ids = [_token_at(item.request, item.start) for item in decodes]
    step = _decode_rows(decodes, token_ids, page_size)
    for item in items[num_decodes:]:
        req, start, end = item.request, item.start, item.end
        num_pages = -(-end // page_size)
        step.input_ids.extend(_token_ids(req, start, end))
        step.positions.extend(range(start, end))
        # Slots page by page: tokens [start, end) cut at page boundaries.
        pos = start
        while pos < end:
            page_end = min(end, (pos // page_size + 1) * page_size)
            base = req.page_ids[pos // page_size] * page_size - (pos // page_size) * page_size
            step.slots.extend(range(base + pos, base + page_end))
            pos = page_end
        step.query_lens.append(item.num_new_tokens)
        step.kv_lens.append(end)
        step.page_tables.append(req.page_ids[:num_pages])
        if item.samples:
            step.sample_rows.append(len(step.input_ids) - 1)
    return step


def decode_step_inputs(items: list[ScheduledRequest], page_size: int) -> StepInputs:
    """A decode step whose token ids are not on the host yet (they are the previous
    step's samples, still on the device): zeros here, which `run_decode` replaces with
    the device ids before the model reads them."""
    return _decode_rows(items, [0] * len(items), page_size)


def _decode_rows(items: list[ScheduledRequest], token_ids: list[int], page_size: int) -> StepInputs:
    """Rows of single-token sampling items (`token_ids` in item order), a list at a time:
    the per-token work of a big decode batch."""
    positions = [item.start for item in items]
    page_lists = [item.request.page_ids for item in items]
    # Pages [0, pos // page_size] hold tokens [0, pos]; the request's own list when it
    # holds exactly those (the common case), which also keeps its identity for the
    # graph runner's persistent page table.
    page_tables = [
        pages if len(pages) == pos // page_size + 1 else pages[: pos // page_size + 1]
        for pages, pos in zip(page_lists, positions)
    ]
    return StepInputs(
        input_ids=token_ids,
        positions=positions,
        slots=[
            pages[pos // page_size] * page_size + pos % page_size
            for pages, pos in zip(page_lists, positions)
        ],
        query_lens=[1] * len(items),
        kv_lens=[pos + 1 for pos in positions],
        page_tables=page_tables,
        sample_rows=list(range(len(items))),
    )


def _token_at(req: Request, pos: int) -> int:
    prompt_len = len(req.prompt_ids)
    return req.output_ids[pos - prompt_len] if pos >= prompt_len else req.prompt_ids[pos]


def _token_ids(req: Request, start: int, end: int) -> list[int]:
    # Avoid `req.token_ids` (a fresh prompt + output list) for the common cases.
    prompt_len = req.prompt_len
    if start >= prompt_len:
        return req.output_ids[start - prompt_len : end - prompt_len]
    if end <= prompt_len:
        return req.prompt_ids[start:end]
    return req.token_ids[start:end]


def paged_tensors_host(step: StepInputs) -> torch.Tensor:
    """int32 [2 * num_seqs + 1 + num_seqs * width]: query_start_loc, seq_lens and the
    zero-padded page table, packed so one host-to-device copy moves them all."""
    width = max((len(pages) for pages in step.page_tables), default=0)
    packed = [0]
    for query_len in step.query_lens:
        packed.append(packed[-1] + query_len)
    packed.extend(step.kv_lens)
    for pages in step.page_tables:
        packed.extend(pages)
        packed.extend([0] * (width - len(pages)))
    return torch.tensor(packed, dtype=torch.int32)


def unpack_paged_tensors(packed: torch.Tensor, step: StepInputs) -> PagedTensors:
    num_seqs = step.num_seqs
    width = (packed.numel() - 2 * num_seqs - 1) // max(1, num_seqs)
    num_decodes = step.num_decodes
    return PagedTensors(
        query_start_loc=packed[: num_seqs + 1],
        seq_lens=packed[num_seqs + 1 : 2 * num_seqs + 1],
        page_table=packed[2 * num_seqs + 1 :].view(num_seqs, width),
        num_decodes=num_decodes,
        max_query_len=max(step.query_lens[num_decodes:], default=0),
    )


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        page_size: int,
        device: torch.device,
        graphs: CudaGraphRunner | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.page_size = page_size
        self.device = device
        self.graphs = graphs  # None: every step runs eagerly
        self.needs_tensors = bool(getattr(backend, "needs_tensors", False))

    def to_device(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids, positions and metadata on the device: one copy for the int64 inputs,
        and (for backends that read tensors) one for the int32 layout."""
        num_tokens = len(step.input_ids)
        host = torch.tensor(step.input_ids + step.positions + step.slots, dtype=torch.long)
        packed = host.to(self.device, non_blocking=True)
        tensors = None
        if self.needs_tensors:
            layout = paged_tensors_host(step).to(self.device, non_blocking=True)
            tensors = unpack_paged_tensors(layout, step)
        meta = AttentionMetadata(
            query_lens=step.query_lens,
            kv_lens=step.kv_lens,
            page_tables=step.page_tables,
            slot_mapping=packed[2 * num_tokens :],
            tensors=tensors,
        )
        return packed[:num_tokens], packed[num_tokens : 2 * num_tokens], meta

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """Float32 logits `[num_sampling_items, vocab]`, in batch order."""
        return self.run_step(build_step_inputs(batch, self.page_size))

    @torch.inference_mode()
    def run_step(self, step: StepInputs) -> torch.Tensor:
        """`run` of a batch's step inputs (what a tensor-parallel follower receives)."""
        if self.graphs is not None and self.graphs.can_run(step):
            return self.graphs.run(step)
        ids, positions, meta = self.to_device(step)
        hidden = self.model(ids, positions, BoundAttention(self.backend, meta))
        if len(step.sample_rows) < len(step.input_ids):
            index = torch.tensor(step.sample_rows, dtype=torch.long).to(self.device)
            hidden = hidden[index]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run_with_prompt_rows(self, batch: Batch) -> tuple[torch.Tensor, list[PromptRows]]:
        """`run`, plus the hidden states of the prompt positions whose logprobs are asked
        for (eager: such a step is a prefill chunk, never a graph's decode)."""
        step = build_step_inputs(batch, self.page_size)
        ids, positions, meta = self.to_device(step)
        hidden = self.model(ids, positions, BoundAttention(self.backend, meta))
        prompt_rows = [
            PromptRows(req, first_pos, hidden[row : row + num_rows])
            for req, row, first_pos, num_rows in prompt_rows_wanted(batch)
        ]
        index = torch.tensor(step.sample_rows, dtype=torch.long).to(self.device)
        return self.model.compute_logits(hidden[index]), prompt_rows

    @torch.inference_mode()
    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run_decode(self, items: list[ScheduledRequest], input_ids: torch.Tensor) -> torch.Tensor:
        """A decode step (one token per item) whose input ids are already on the device,
        in item order: the overlapped path. Float32 logits `[len(items), vocab]`."""
        return self.run_decode_step(decode_step_inputs(items, self.page_size), input_ids)

    @torch.inference_mode()
    def run_decode_step(self, step: StepInputs, input_ids: torch.Tensor) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(step):
            return self.graphs.run(step, input_ids)
        _, positions, meta = self.to_device(step)
        hidden = self.model(input_ids, positions, BoundAttention(self.backend, meta))
        return self.model.compute_logits(hidden)

    def close(self) -> None:
        """Nothing to release: the model and pool belong to the engine's parts."""


def build_runner(
    config: EngineConfig,
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    device: torch.device,
    max_model_len: int,
) -> ModelRunner:
    """The runner with the speed tricks this device allows: fused Triton elementwise
    kernels with merged q/k/v and gate/up projections (off: --disable-fused-ops), launched
    with programmatic dependent launch on Hopper+ (off: --disable-pdl), and CUDA graphs
    for decode steps (off: --disable-cuda-graph). On CPU none applies and the step is the
    reference path."""
    speed = config.speed
    if device.type == "cuda" and not speed.disable_fused_ops:
        from kvstrata.model.triton_ops import make_triton_ops
        from kvstrata.pdl import pdl_for

        model.set_ops(make_triton_ops(pdl_for(device, speed.disable_pdl)))
        model.merge_projections()
    graphs = None
    if device.type == "cuda" and not speed.disable_cuda_graph:
        from kvstrata.engine.cuda_graph import make_cuda_graph_runner

        graphs = make_cuda_graph_runner(config, model, backend, device, max_model_len)
    return ModelRunner(model, backend, config.pool.page_size, device, graphs)
