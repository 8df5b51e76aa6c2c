"""`ResponseHomes`: which decode rank holds each Responses API answer the router relayed
(learned from the rank's `X-Kvstrata-Response-Id` header), so that a follow-up naming it
(`previous_response_id`) goes where its conversation and KV are, and GET/DELETE of it to
the rank that stored it. Bounded; the least recently used go first. Event loop only."""

from __future__ import annotations

from collections import OrderedDict

from kvstrata.http.responses_api import RESPONSE_ID_HEADER

__all__ = ["RESPONSE_ID_HEADER", "ResponseHomes"]

MAX_RESPONSE_ID_CHARS = 128


class ResponseHomes:
    def __init__(self, max_responses: int = 65536) -> None:
        self.max_responses = max_responses
        self._homes: OrderedDict[str, str] = OrderedDict()  # response id -> rank URL

    def learn(self, response_id: str | None, rank_url: str) -> None:
        if not response_id or len(response_id) > MAX_RESPONSE_ID_CHARS:
            return
        self._homes[response_id] = rank_url
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.max_responses:
            self._homes.popitem(last=False)

    def home_of(self, response_id: str | None) -> str | None:
        if response_id is None:
            return None
        url = self._homes.get(response_id)
        if url is not None:
            self._homes.move_to_end(response_id)
        return url

    def __len__(self) -> int:
        return len(self._homes)
