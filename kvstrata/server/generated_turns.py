"""`GeneratedTurns`: the tokens a rank generated for its recent chat answers, keyed by the
conversation before the answer and the answer as the client got it (content and tool
calls), so that when a conversation sends an answer back in its history, the prompt
carries the tokens the model generated rather than the template's re-rendering (which may
drop a think block, re-serialize a call, or tokenize the same text otherwise): turn k+1's
prompt then extends turn k's prompt and output token for token, and hits the cache (issue
30.4). Bounded LRU; event loop only."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstrata.http.protocol import ChatMessage


def conversation_key(messages: Sequence[ChatMessage]) -> bytes:
    """The messages an answer was generated for, as data (so a client's re-serialization
    of the same history matches). It is part of an answer's key so that only the same
    conversation gets the answer's tokens spliced in: those may hold what its client never
    saw (a think block the template drops), which another conversation sending the same
    answer text must not get in its prompt."""
    digest = hashlib.sha256()
    for message in messages:
        _add(digest, message)
    return digest.digest()


def _add(digest: Any, message: ChatMessage) -> None:
    calls = [(c.function.name, _data(c.function.arguments)) for c in message.tool_calls or []]
    item = [message.role, message.text(), message.name, message.tool_call_id, calls]
    digest.update(json.dumps(item, ensure_ascii=False, sort_keys=True).encode() + b"\n")


def _data(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments  # not JSON: compared as text


def turn_key(context: bytes, content: str | None, calls: Sequence[tuple[str, str]]) -> bytes:
    """An answer as the client holds it, after the conversation `context`: its content
    and its calls' names and arguments (parsed, so their JSON text compares as data)."""
    normalized = [(name, json.loads(arguments)) for name, arguments in calls]
    blob = json.dumps([content or "", normalized], ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(context + blob.encode()).digest()


def message_key(context: bytes, message: ChatMessage) -> bytes | None:
    """The key of an assistant message of a request's history (None if its arguments are
    not JSON: it cannot be one of ours)."""
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    try:
        return turn_key(context, message.text() or None, calls)
    except json.JSONDecodeError:
        return None


class GeneratedTurns:
    """At most `max_turns` answers' token ids, least recently used dropped first."""

    def __init__(self, max_turns: int) -> None:
        self.max_turns = max_turns
        self._turns: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()

    def remember(self, key: bytes, token_ids: Sequence[int]) -> None:
        if self.max_turns <= 0 or not token_ids:
            return
        self._turns[key] = tuple(token_ids)
        self._turns.move_to_end(key)
        while len(self._turns) > self.max_turns:
            self._turns.popitem(last=False)

    def tokens_of(self, key: bytes | None) -> list[int] | None:
        ids = self._turns.get(key) if key is not None else None
        if ids is None or key is None:
            return None
        self._turns.move_to_end(key)
        return list(ids)

    def generated_in(self, messages: Sequence[ChatMessage]) -> dict[int, list[int]]:
        """Message index -> generated tokens, for the history's answers this rank holds
        (each after the same conversation it was generated for)."""
        found: dict[int, list[int]] = {}
        if self.max_turns <= 0 or not self._turns:
            return found
        context = hashlib.sha256()  # conversation_key of the messages before `index`
        for index, message in enumerate(messages):
            if message.role == "assistant":
                ids = self.tokens_of(message_key(context.digest(), message))
                if ids is not None:
                    found[index] = ids
            _add(context, message)
        return found

    def __len__(self) -> int:
        return len(self._turns)
