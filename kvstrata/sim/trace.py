"""A Mooncake-format request trace and the synthetic tokens behind it: each hash id is a
block of `block_size` deterministic token ids (the last block of a prompt truncated), and
page hashes are memoized per block, since an id names its whole prefix (ids chain)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvstrata.kvcache.hashing import page_hashes

SIM_NAMESPACE = b"kvstrata/sim/namespace/v1".ljust(32, b"\0")  # the seed of every sim rank


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, max_requests: int = 0, speedup: float = 1.0) -> list[TraceRequest]:
    """Requests in file order (timestamps are non-decreasing in Mooncake traces; they are
    sorted here anyway). Raises ValueError naming the line of a malformed entry."""
    requests: list[TraceRequest] = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                request = TraceRequest(
                    len(requests),
                    float(entry["timestamp"]) / 1000 / speedup,
                    int(entry["input_length"]),
                    int(entry["output_length"]),
                    tuple(int(h) for h in entry["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: not a trace entry: {e}") from e
            requests.append(request)
            if max_requests and len(requests) == max_requests:
                break
    return sorted(requests, key=lambda r: (r.arrival_s, r.index))


class TraceTokens:
    """Token ids and page hashes of trace requests. Block `b` holds the token ids
    `b * block_size + i`: distinct blocks never share a token, so the radix tree shares
    exactly the prefixes the hash ids say are shared."""

    def __init__(self, block_size: int, page_size: int) -> None:
        self.block_size = block_size
        self.page_size = page_size
        self._block_hashes: dict[int, list[bytes]] = {}  # every full page of the block

    def token_ids(self, request: TraceRequest) -> list[int]:
        tokens: list[int] = []
        for block_id in request.hash_ids:
            start = block_id * self.block_size
            tokens.extend(range(start, start + self.block_size))
        del tokens[request.input_len :]
        return tokens

    def page_hashes(self, request: TraceRequest) -> list[bytes]:
        """Chained hashes of the request's full pages. A block's pages depend only on its
        id (and so its prefix), so each block is hashed once for the whole trace."""
        hashes: list[bytes] = []
        prev: bytes | None = None
        for block_id in request.hash_ids:
            block = self._block_hashes.get(block_id)
            if block is None:
                start = block_id * self.block_size
                block = page_hashes(
                    range(start, start + self.block_size), self.page_size, SIM_NAMESPACE, prev
                )
                self._block_hashes[block_id] = block
            hashes.extend(block)
            prev = block[-1]
        del hashes[request.input_len // self.page_size :]
        return hashes
