"""Mooncake trace replay: the records of a JSONL trace file and the synthetic tokens each
hash id stands for. The mapping is a pure function of (seed, hash id, block length,
vocabulary), so equal hash ids give equal token blocks and the trace's prefix sharing
becomes prefix sharing of the prompts sent."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRACE_BLOCK_SIZE = 512  # tokens per hash id in the Mooncake traces


@dataclass(frozen=True)
class TraceRecord:
    """One request of the trace. Invariant (checked on load):
    (len(hash_ids) - 1) * block_size < input_len <= len(hash_ids) * block_size."""

    timestamp_ms: int
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]


def load_trace(
    path: str | Path, block_size: int = TRACE_BLOCK_SIZE, max_records: int = 0, skip: int = 0
) -> list[TraceRecord]:
    """`max_records` records (0: all) of a Mooncake JSONL trace after the first `skip`, in
    file order. Raises ValueError naming the line of a malformed record."""
    records: list[TraceRecord] = []
    num_seen = 0
    with Path(path).open() as file:
        for line_no, line in enumerate(file, start=1):
            if max_records and len(records) >= max_records:
                break
            if not line.strip():
                continue
            num_seen += 1
            if num_seen <= skip:
                continue
            try:
                records.append(_record(json.loads(line), block_size))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: not a Mooncake trace record: {e}") from e
    return records


def _record(body: dict, block_size: int) -> TraceRecord:
    hash_ids = tuple(int(h) for h in body["hash_ids"])
    record = TraceRecord(
        int(body["timestamp"]), int(body["input_length"]), int(body["output_length"]), hash_ids
    )
    if record.input_len < 1 or record.output_len < 0 or any(h < 0 for h in hash_ids):
        raise ValueError("lengths and hash ids must be non-negative, input_length >= 1")
    if not (len(hash_ids) - 1) * block_size < record.input_len <= len(hash_ids) * block_size:
        raise ValueError(
            f"input_length {record.input_len} does not fit {len(hash_ids)} blocks of "
            f"{block_size} tokens (check --trace-block-size)"
        )
    return record


def block_tokens(hash_id: int, block_len: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """The synthetic token ids (int64, in [0, vocab_size)) of one trace block."""
    rng = np.random.default_rng([seed, hash_id])
    return rng.integers(0, vocab_size, size=block_len, dtype=np.int64)


class TraceTokens:
    """Builds the prompts of trace records; each block's tokens are drawn once and kept.

    `replay_block_len` tokens per hash id (<= `block_size`): the prompt keeps the record's
    blocks and scales its length by replay_block_len / block_size, rounding up, so the
    scaled length still ends inside the last block."""

    def __init__(
        self, block_size: int, replay_block_len: int, vocab_size: int, seed: int = 0
    ) -> None:
        if not 1 <= replay_block_len <= block_size:
            raise ValueError("the replay block length must be in [1, block_size]")
        self.block_size = block_size
        self.replay_block_len = replay_block_len
        self.vocab_size = vocab_size
        self.seed = seed
        self._blocks: dict[int, np.ndarray] = {}

    def input_len(self, record: TraceRecord) -> int:
        return math.ceil(record.input_len * self.replay_block_len / self.block_size)

    def prompt(self, record: TraceRecord, max_len: int = 0) -> list[int]:
        """The record's prompt, cut to `max_len` tokens if that is > 0 (a cut keeps the
        prefix, so sharing between prompts survives it)."""
        length = self.input_len(record)
        if max_len:
            length = min(length, max_len)
        num_blocks = math.ceil(length / self.replay_block_len)
        blocks = [self._block(h) for h in record.hash_ids[:num_blocks]]
        return np.concatenate(blocks)[:length].tolist()

    def _block(self, hash_id: int) -> np.ndarray:
        block = self._blocks.get(hash_id)
        if block is None:
            block = block_tokens(hash_id, self.replay_block_len, self.vocab_size, self.seed)
            self._blocks[hash_id] = block
        return block
