"""`ResponseStore`: the Responses API's stored responses of one rank (`store`: true), each
with the conversation a follow-up (`previous_response_id`) continues, bounded in count and
age (`--responses-max-stored`, `--responses-max-age-s`): the oldest go first. Event loop
only."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvstrata.http.protocol import ChatMessage


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as GET /v1/responses/{id} returns it
    conversation: list[ChatMessage]  # its history, input and output, without instructions
    stored_s: float  # time.monotonic() when it was stored
    session_id: str | None = None  # the agent session it was a turn of (kvcache/sessions.py)


class ResponseStore:
    def __init__(self, max_count: int, max_age_s: float) -> None:
        self.max_count = max_count
        self.max_age_s = max_age_s
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(
        self,
        response_id: str,
        body: dict[str, Any],
        conversation: list[ChatMessage],
        session_id: str | None = None,
    ) -> None:
        if self.max_count <= 0:
            return
        self._expire()
        self._responses[response_id] = StoredResponse(
            body, conversation, time.monotonic(), session_id
        )
        while len(self._responses) > self.max_count:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None

    def _expire(self) -> None:
        oldest_kept_s = time.monotonic() - self.max_age_s
        while self._responses:
            first = next(iter(self._responses.values()))
            if first.stored_s >= oldest_kept_s:
                return
            self._responses.popitem(last=False)

    def __len__(self) -> int:
        return len(self._responses)
