"""What the router expects a rank to hold of a request: the match of the request's
chunk-boundary hashes against the rank's digest (plus the prefixes the router sent there
since), split into L1 and L2 tokens, whether the rank has KV room for the rest, and the
router's memory of the prefixes it sent to each rank."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstrata.router.policy import RankView, RoutingRequest


@dataclass(frozen=True)
class PrefixEstimate:
    """Prompt tokens a rank is expected to serve from its cache, whole chunks only.

    [0, l1_tokens) from L1 | [l1_tokens, matched_tokens) from L2 | the rest computed"""

    matched_tokens: int
    l1_tokens: int

    @property
    def l2_tokens(self) -> int:
        return self.matched_tokens - self.l1_tokens

    def cut(self, matched_tokens: int) -> PrefixEstimate:
        """The first `matched_tokens` of this match at most (L1 tokens come first)."""
        matched_tokens = min(matched_tokens, self.matched_tokens)
        return PrefixEstimate(matched_tokens, min(self.l1_tokens, matched_tokens))


NO_MATCH = PrefixEstimate(0, 0)


def estimate_prefix(request: RoutingRequest, rank: RankView) -> PrefixEstimate:
    """The deepest chunk boundary of `request` present in the rank's digest or among the
    prefixes routed there since (those count as L1: the rank will hold them in L1)."""
    digest = rank.digest
    if digest is None or digest.version is None or not request.has_tokens:
        return NO_MATCH
    hashes = request.boundary_hashes(digest.namespace, digest.page_size, digest.chunk_size)
    match = digest.match(hashes, rank.routed_prefixes)
    return PrefixEstimate(
        match.num_chunks * digest.chunk_size, match.num_l1_chunks * digest.chunk_size
    )


def distinguishing_tokens(
    request: RoutingRequest, estimates: Mapping[int, PrefixEstimate], threshold: float
) -> dict[int, int]:
    """Per rank, the matched tokens beyond the part every candidate holds (a prefix all
    of them cache, e.g. a common system prompt, says nothing about where to go), or 0
    where the whole match is below `threshold` x the prompt's tokens (too little to be
    worth following: the request is treated as new). A rank index -> tokens.

        [0, common) held by every candidate | [common, matched) this rank's own match"""
    if not estimates:
        return {}
    common = min(e.matched_tokens for e in estimates.values())
    min_tokens = threshold * request.num_prompt_tokens
    return {
        index: e.matched_tokens - common if e.matched_tokens >= min_tokens else 0
        for index, e in estimates.items()
    }


def routed_boundary_hashes(request: RoutingRequest, rank: RankView) -> list[bytes]:
    """The boundary hashes to remember for `request` routed to `rank` (none without a
    digest: the router does not know how that rank hashes)."""
    digest = rank.digest
    if digest is None or digest.version is None or not request.has_tokens:
        return []
    return request.boundary_hashes(digest.namespace, digest.page_size, digest.chunk_size)


def has_room(rank: RankView, request: RoutingRequest, estimate: PrefixEstimate) -> bool:
    """Whether the rank's free plus evictable KV pages, less what the router sent it
    since the last poll, cover the request's unmatched tokens. Unknown (no load or no
    page size yet) counts as room."""
    if rank.load is None or rank.digest is None or not rank.digest.page_size:
        return True
    page_size = rank.digest.page_size
    num_needed_pages = -(-(request.num_prompt_tokens - estimate.matched_tokens) // page_size)
    num_routed_pages = -(-rank.num_routed_new_tokens_since_poll // page_size)
    # The matched pages are cached but will be pinned, so they are not evictable room.
    num_matched_pages = estimate.matched_tokens // page_size
    num_room_pages = rank.load.num_available_pages - num_matched_pages - num_routed_pages
    return num_needed_pages <= num_room_pages


class RoutedPrefixes:
    """The boundary hashes of requests this router sent to one rank, counted from the
    decision until a poll sent after the request ended has answered: by then the rank's
    digest shows whatever the request left in its cache. Lives on the router's loop."""

    def __init__(self) -> None:
        self.counts: dict[bytes, int] = {}
        self._ended: deque[tuple[int, Sequence[bytes]]] = deque()  # (end sequence, hashes)

    def add(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self.counts[h] = self.counts.get(h, 0) + 1

    def end(self, hashes: Sequence[bytes], end_seq: int) -> None:
        if hashes:
            self._ended.append((end_seq, hashes))

    def settle(self, num_ended_at_poll: int) -> None:
        """A poll sent when `num_ended_at_poll` requests had ended has answered."""
        while self._ended and self._ended[0][0] < num_ended_at_poll:
            for h in self._ended.popleft()[1]:
                left = self.counts[h] - 1
                if left:
                    self.counts[h] = left
                else:
                    del self.counts[h]
