"""Requests that take ranks down with them: the router's bounded memory (LRU, with a time
to live) of request bodies whose attempt ended in a rank's engine failure or with the rank
dead while holding it, so that one body takes at most two ranks down, and identical bodies
are refused for a while after that. Lives on the router's event loop."""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.config import RouterConfig

# Attempts of one body that may end with their rank down before the body is quarantined.
MAX_STRIKES = 2
ENGINE_FAILURE = "an engine failure"  # the rank answered 500 engine_failed
DIED_HOLDING_IT = "a connection reset"  # the connection broke after the request was sent


@dataclass(frozen=True)
class Strike:
    """One attempt of a body that ended with its rank down."""

    rank_url: str
    what: str  # ENGINE_FAILURE or DIED_HOLDING_IT


@dataclass
class _Record:
    strikes: list[Strike]
    expires_s: float  # the last strike + the memory's time to live


@dataclass(frozen=True)
class Quarantine:
    """A body refused because MAX_STRIKES of its attempts ended with their rank down."""

    strikes: tuple[Strike, ...]
    num_seconds_left: float

    @property
    def message(self) -> str:
        return (
            f"this request was refused: {describe(self.strikes)}; identical requests are "
            f"refused for {self.num_seconds_left:.0f} s more (--poison-memory-s)"
        )


def describe(strikes: tuple[Strike, ...] | list[Strike]) -> str:
    """E.g. 'it ended in an engine failure on http://a and a connection reset on http://b'."""
    parts = [f"{s.what} on {s.rank_url}" for s in strikes]
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"identical requests ended in {listed}"


def quarantine_note(strikes: tuple[Strike, ...], memory_s: float) -> str:
    """What the answer that puts a body in quarantine adds to its message."""
    return (
        f"{describe(strikes)}, so it may be what takes ranks down; identical requests are "
        f"refused for {memory_s:.0f} s (--poison-memory-s)"
    )


def body_digest(path: str, body: bytes | bytearray) -> bytes:
    """What identifies a request here: sha256 of its path and its body bytes."""
    digest = hashlib.sha256(path.encode())
    digest.update(b"\0")
    digest.update(body)
    return digest.digest()


class PoisonLedger:
    """Bodies with strikes, each remembered `memory_s` after its last strike, at most
    `max_bodies` of them (the least recently struck is forgotten first). A body with
    MAX_STRIKES strikes is quarantined while it is remembered.

    Strikes are by body, not by client: innocent requests that shared a rank with a
    killer when it died get a strike too, and are quarantined only if that happens to
    them twice within the memory."""

    def __init__(
        self, memory_s: float, max_bodies: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.memory_s = memory_s
        self.max_bodies = max_bodies
        self.clock = clock
        # Ordered by last strike, oldest first: that is also the order they expire in.
        self._records: OrderedDict[bytes, _Record] = OrderedDict()

    @classmethod
    def of(cls, config: RouterConfig) -> PoisonLedger:
        return cls(config.poison_memory_s, config.poison_max_bodies)

    def __len__(self) -> int:
        self._expire()
        return len(self._records)

    def strikes(self, digest: bytes) -> tuple[Strike, ...]:
        record = self._live(digest)
        return () if record is None else tuple(record.strikes)

    def quarantine(self, digest: bytes) -> Quarantine | None:
        """The quarantine of this body, None if it may be sent."""
        record = self._live(digest)
        if record is None or len(record.strikes) < MAX_STRIKES:
            return None
        return Quarantine(tuple(record.strikes), record.expires_s - self.clock())

    def strike(self, digest: bytes, rank_url: str, what: str) -> tuple[Strike, ...]:
        """An attempt of this body ended with its rank down: every strike of the body
        remembered now (MAX_STRIKES or more: it is quarantined from now on)."""
        record = self._live(digest) or _Record([], 0.0)
        record.strikes = [*record.strikes[-(MAX_STRIKES - 1) :], Strike(rank_url, what)]
        record.expires_s = self.clock() + self.memory_s
        self._records.pop(digest, None)
        self._records[digest] = record  # most recently struck last
        while len(self._records) > self.max_bodies:
            self._records.popitem(last=False)
        return tuple(record.strikes)

    def _live(self, digest: bytes) -> _Record | None:
        self._expire()
        return self._records.get(digest)

    def _expire(self) -> None:
        now_s = self.clock()
        while self._records:
            oldest = next(iter(self._records.values()))
            if oldest.expires_s > now_s:
                break
            self._records.popitem(last=False)
