"""Turns a scheduled batch into model inputs (token ids, positions, attention metadata),
runs the model and returns the logits of the rows that sample a token."""

from __future__ import annotations

import torch

from kvstrata.attention.base import AttentionBackend, AttentionMetadata, BoundAttention
from kvstrata.core import Batch
from kvstrata.model.llama import LlamaForCausalLM


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        page_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.page_size = page_size
        self.device = device

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        page_size = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        page_tables: list[list[int]] = []
        for item in batch.items:
            req = item.request
            token_ids = req.token_ids
            input_ids.extend(token_ids[item.start : item.end])
            for pos in range(item.start, item.end):
                positions.append(pos)
                slots.append(req.page_ids[pos // page_size] * page_size + pos % page_size)
            page_tables.append(req.page_ids[: -(-item.end // page_size)])
        meta = AttentionMetadata(
            query_lens=[item.num_new_tokens for item in batch.items],
            kv_lens=[item.end for item in batch.items],
            page_tables=page_tables,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos_t, meta

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """Float32 logits `[num_sampling_items, vocab]`, in batch order."""
        ids, positions, meta = self.prepare(batch)
        hidden = self.model(ids, positions, BoundAttention(self.backend, meta))
        last_rows: list[int] = []
        offset = 0
        for item in batch.items:
            offset += item.num_new_tokens
            if item.samples:
                last_rows.append(offset - 1)
        index = torch.tensor(last_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[index])
