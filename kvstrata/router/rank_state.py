"""The router's record of one rank (`RankState`: health, last load, digest copy, its own
in-flight and routed counts and prefixes, observed TTFT, membership) and the small
records around it. Lives on the router's event loop (or in the simulator's thread)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstrata.kvcache.digest_wire import DigestReplica
from kvstrata.router.policy import RankLoad, RankView
from kvstrata.router.prefix import RoutedPages, RoutedPrefixes


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class PollMark:
    """The rank's routed and ended counts when a poll was sent: decisions after it may
    be missing from the load that poll returns, requests ended after it may be in it."""

    num_routed: int
    num_routed_tokens: int
    num_routed_new_tokens: int = 0
    num_ended: int = 0


@dataclass
class RoutedRequest:
    """One request's place in a rank's routed counts, handed back at its first token and
    its end. `num_unprefilled_tokens`: its new tokens, until its first token is seen."""

    boundary_hashes: Sequence[bytes] = ()
    num_unprefilled_tokens: int = 0
    # The record its hashes were added to (a rank's is replaced when its cache resets).
    prefixes: RoutedPrefixes | None = None


@dataclass
class RankState:
    """The router's record of one rank."""

    role: Role
    index: int
    url: str
    # Not healthy until the first poll answers: a rank that never came up gets nothing.
    healthy: bool = False
    num_consecutive_failures: int = 0
    # Polls in a row that timed out while the rank's /health answered: busy, not dead.
    num_consecutive_slow_polls: int = 0
    last_error: str | None = None
    load: RankLoad | None = None
    num_inflight: int = 0
    num_routed: int = 0  # every decision for this rank since the router started
    num_routed_tokens: int = 0
    num_routed_new_tokens: int = 0  # prompt tokens not expected to be cached there
    num_ended: int = 0  # requests of this router that ended (answered or failed)
    # New (uncached) tokens of this router's requests there whose first token it has not
    # seen: prefill work the rank still owes, including a request it is computing now,
    # which its own queued-token count leaves out. Streams count out at the first token,
    # other answers at their end.
    num_unprefilled_tokens: int = 0
    mark: PollMark = PollMark(0, 0)  # counts when the poll that sent `load` was sent
    num_routed_at_answer: int = 0  # `num_routed` when that poll's answer arrived
    digest: DigestReplica | None = None  # None: the rank serves no digest (yet)
    digest_dropped: bool = False  # the last delta was out of sequence: snapshot pending
    digest_problem: str | None = None  # why the last answer had no usable digest
    routed: RoutedPrefixes = field(default_factory=RoutedPrefixes)
    routed_pages: RoutedPages = field(default_factory=RoutedPages)  # first chunks, by page
    ttft_scale: float = 1.0
    # The digest epoch last applied: a full digest of another epoch means the rank's cache
    # was reset (flush, restart), and the router forgets what it routed there.
    digest_epoch: str | None = None
    events_live: bool = False  # its event stream is up: it is not polled
    event_mark: PollMark = PollMark(0, 0)  # counts when the last event arrived
    worker_id: str = ""  # the id of POST /workers and DELETE /workers/{id}
    order: int = 0  # the lists are sorted by it (the rank's --rank, or its CLI position)
    registered: bool = False  # it registered itself (else it was on the command line)
    unhealthy_since_s: float | None = None  # monotonic time it was last marked unhealthy

    @property
    def name(self) -> str:
        return f"{self.role.value} rank {self.index} ({self.url})"

    def view(self) -> RankView:
        return RankView(
            index=self.index,
            url=self.url,
            healthy=self.healthy,
            load=self.load,
            num_inflight=self.num_inflight,
            num_routed_since_poll=self.num_routed - self.mark.num_routed,
            num_routed_tokens_since_poll=self.num_routed_tokens - self.mark.num_routed_tokens,
            num_routed_new_tokens_since_poll=(
                self.num_routed_new_tokens - self.mark.num_routed_new_tokens
            ),
            num_routed_during_poll=self.num_routed_at_answer - self.mark.num_routed,
            num_ended_since_poll=self.num_ended - self.mark.num_ended,
            num_unprefilled_tokens=self.num_unprefilled_tokens,
            digest=self.digest,
            routed_prefixes=self.routed.counts,
            routed_pages=self.routed_pages.pages,
            ttft_scale=self.ttft_scale,
        )

    def to_json(self) -> dict[str, Any]:
        view = self.view()
        return {
            "id": self.worker_id,
            "role": self.role.value,
            "index": self.index,
            "url": self.url,
            "registered": self.registered,
            "events_live": self.events_live,
            "healthy": self.healthy,
            "num_consecutive_failures": self.num_consecutive_failures,
            "num_consecutive_slow_polls": self.num_consecutive_slow_polls,
            "last_error": self.last_error,
            "num_inflight": self.num_inflight,
            "num_routed": self.num_routed,
            "num_routed_since_poll": view.num_routed_since_poll,
            "num_routed_prefixes": len(self.routed.counts),
            "num_routed_pages": len(self.routed_pages.pages),
            "ttft_scale": self.ttft_scale,
            "digest": None
            if self.digest is None
            else {
                "epoch": self.digest.epoch,
                "version": self.digest.version,
                "chunk_size": self.digest.chunk_size,
                "num_entries": len(self.digest.entries),
            },
            "load": self.load.to_json() if self.load is not None else None,
        }
