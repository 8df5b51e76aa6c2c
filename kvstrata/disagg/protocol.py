"""The messages of one prefill-to-decode handoff (a room), named for the end that acts on
them: decode sends a `PrefillTask` naming the token range and its own destination pages,
prefill answers with a `PrefillResult`; on the wire both pass the strict schemas of
disagg/wire.py. Where a room stands is the decode rank's `RoomTable` (rooms.py)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from kvstrata.core import TokenLogprobs
from kvstrata.disagg.transport.endpoints import Endpoint


@dataclass(frozen=True)
class PrefillTask:
    """Compute `token_ids` and write KV of tokens [prefix_len, len(token_ids)) into the
    decode rank's pages `dst_page_ids` (one per page of that range, page-aligned since
    prefix_len is a multiple of page_size)."""

    room: str
    token_ids: list[int]
    prefix_len: int
    dst_page_ids: list[int]
    decode_endpoint: Endpoint  # the decode rank's transport description
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> PrefillTask:
        """Checked against the schema (disagg/wire.py); raises ValueError naming the field.
        The receiving rank's own limits are `wire.TaskLimits`."""
        from kvstrata.disagg.wire import WirePrefillTask

        return WirePrefillTask.model_validate_json(json.dumps(data)).to_task()


@dataclass(frozen=True)
class PrefillResult:
    room: str
    first_token_id: int
    num_pages_written: int
    prefill_cached_tokens: int  # prefill's own radix hit, for its metrics
    # What the room cost the prefill rank, for the decode rank's path costs: from the
    # task's arrival to its first token (queue and compute), and the write's duration.
    prefill_s: float = 0.0
    send_s: float = 0.0
    # The first token's logprobs, when the task's sampling asks for them (params.logprobs)
    first_token_logprobs: TokenLogprobs | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        record = self.first_token_logprobs
        if record is not None:
            data["first_token_logprobs"] = {
                "token_id": record.token_id,
                "logprob": record.logprob,
                "top_token_ids": [t for t, _ in record.top],
                "top_logprobs": [lp for _, lp in record.top],
            }
        return data

    @staticmethod
    def from_json(data: Any) -> PrefillResult:
        """Checked against the schema (disagg/wire.py): unknown fields, wrong types and
        negative counts raise ValueError naming the field."""
        from kvstrata.disagg.wire import parse_result

        return parse_result(data)
