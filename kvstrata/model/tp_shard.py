"""Which part of the model one tensor-parallel worker holds: its attention heads (KV heads
replicated where the group is larger than their count), its slice of the MLP, its rows of
the vocabulary; the model config of that part, and each checkpoint tensor cut to it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvstrata.model.config import ModelConfig


class ShardError(ValueError):
    """The model cannot be split `size` ways (names the dimension)."""


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int

    def check(self, mc: ModelConfig) -> None:
        """Refuse a split that does not divide, naming the dimension and the flag."""
        size = self.size
        for name, value in (
            ("num_attention_heads", mc.num_heads),
            ("intermediate_size", mc.intermediate_size),
        ):
            if value % size:
                raise ShardError(f"{name} ({value}) is not divisible by --tp-size {size}")
        kv = mc.num_kv_heads
        if kv % size and size % kv:
            raise ShardError(
                f"num_key_value_heads ({kv}) and --tp-size {size}: one must divide the other "
                "(KV heads are split, or replicated when there are fewer than workers)"
            )

    def vocab_rows(self, vocab_size: int) -> int:
        """Rows of the vocabulary per worker; the last worker's are padded with zeros."""
        return -(-vocab_size // self.size)

    def local_config(self, mc: ModelConfig) -> ModelConfig:
        return dataclasses.replace(
            mc,
            num_heads=mc.num_heads // self.size,
            num_kv_heads=max(1, mc.num_kv_heads // self.size),
            intermediate_size=mc.intermediate_size // self.size,
            vocab_size=self.vocab_rows(mc.vocab_size),
        )

    def first_kv_head(self, mc: ModelConfig) -> int:
        if mc.num_kv_heads >= self.size:
            return self.rank * (mc.num_kv_heads // self.size)
        heads_per_kv = mc.num_heads // mc.num_kv_heads
        return self.rank * (mc.num_heads // self.size) // heads_per_kv

    def cut(self, name: str, tensor: torch.Tensor, mc: ModelConfig) -> torch.Tensor:
        """The worker's part of the full checkpoint tensor `name`."""
        local = self.local_config(mc)
        d = mc.head_dim
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = self.vocab_rows(mc.vocab_size)
            part = tensor[self.rank * rows : (self.rank + 1) * rows]
            if part.shape[0] < rows:  # the last worker's padding rows: never looked up
                pad = tensor.new_zeros((rows - part.shape[0], *tensor.shape[1:]))
                part = torch.cat([part, pad])
            return part.contiguous()
        if ".q_proj." in name:
            return _rows(tensor, self.rank * local.q_size, local.q_size)
        if ".k_proj." in name or ".v_proj." in name:
            return _rows(tensor, self.first_kv_head(mc) * d, local.kv_size)
        if name.endswith("o_proj.weight"):
            return _cols(tensor, self.rank * local.q_size, local.q_size)
        if ".gate_proj." in name or ".up_proj." in name:
            size = local.intermediate_size
            return _rows(tensor, self.rank * size, size)
        if name.endswith("down_proj.weight"):
            size = local.intermediate_size
            return _cols(tensor, self.rank * size, size)
        return tensor  # norms: every worker holds them whole


def _rows(tensor: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return tensor[start : start + count].contiguous()


def _cols(tensor: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return tensor[:, start : start + count].contiguous()
