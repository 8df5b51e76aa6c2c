"""`KvEvent`: one line of a rank's `GET /kv_events` stream (JSON lines), what the rank
writes and the router reads back; its kinds and how a reader must check their order."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstrata.kvcache.digest_wire import DigestDelta

KV_EVENTS_MEDIA_TYPE = "application/x-ndjson"


class EventKind(enum.Enum):
    # The whole digest (or None: the rank keeps none) and the load. The first event of
    # every stream, and the event after the rank's cache was reset (a new epoch).
    SNAPSHOT = "snapshot"
    DELTA = "delta"  # the digest's changes since the stream's previous digest event
    LOAD = "load"  # the load changed; the digest did not
    HEARTBEAT = "heartbeat"  # nothing changed; the stream is alive (seq not advanced)
    # The reader fell behind (its queue filled): the stream ends here, and a reader must
    # subscribe again, starting from a snapshot.
    DROPPED = "dropped"


@dataclass(frozen=True)
class KvEvent:
    """One event. `seq` numbers a stream's events from 0 (a heartbeat repeats the last
    number); `epoch` is the rank's digest epoch (a new one on restart, on a cache flush
    and on a new chunk size), or the rank process's own id if it keeps no digest.

    A reader's rules: the first event is a SNAPSHOT; every later one but a heartbeat has
    `seq` one more than the one before, and the epoch of the one before unless it is a
    SNAPSHOT; a DELTA's `digest.base_version` is the version the reader holds. Anything
    else is a gap: subscribe again."""

    kind: EventKind
    seq: int
    epoch: str
    load: Mapping[str, Any] | None = None  # LoadResponse's fields; None for heartbeats
    digest: DigestDelta | None = None  # SNAPSHOT (None: no digest) and DELTA only

    def to_line(self) -> bytes:
        body: dict[str, Any] = {"kind": self.kind.value, "seq": self.seq, "epoch": self.epoch}
        if self.load is not None:
            body["load"] = dict(self.load)
        if self.kind in (EventKind.SNAPSHOT, EventKind.DELTA):
            body["digest"] = self.digest.to_json() if self.digest is not None else None
        return json.dumps(body, separators=(",", ":")).encode() + b"\n"

    @classmethod
    def from_line(cls, line: str | bytes) -> KvEvent:
        """Raises ValueError if the line is not a well-formed event."""
        try:
            body = json.loads(line)
            kind = EventKind(body["kind"])
            seq, epoch, load = body["seq"], body["epoch"], body.get("load")
            raw_digest = body.get("digest")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"malformed kv event: {e!r}") from e
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise ValueError(f"kv event: seq must be a non-negative integer, got {seq!r}")
        if not isinstance(epoch, str) or not epoch:
            raise ValueError(f"kv event: epoch must be a non-empty string, got {epoch!r}")
        needs_load = kind not in (EventKind.HEARTBEAT, EventKind.DROPPED)
        if needs_load and not isinstance(load, dict):
            raise ValueError(f"kv event: a {kind.value} event needs a load object")
        if kind is EventKind.DELTA and raw_digest is None:
            raise ValueError("kv event: a delta event needs a digest")
        digest = DigestDelta.from_json(raw_digest) if raw_digest is not None else None
        if kind is EventKind.SNAPSHOT and digest is not None and not digest.full:
            raise ValueError("kv event: a snapshot's digest must be full")
        return cls(kind, seq, epoch, load if needs_load else None, digest)
