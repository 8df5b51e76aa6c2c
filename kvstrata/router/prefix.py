"""What the router expects a rank to hold of a request: the match of the request's
chunk-boundary hashes against the rank's digest (plus the prefixes the router sent there
since), split into L1 and L2 tokens, or, short of one chunk, the pages of its first chunk
the router sent there; whether the rank has KV room for the rest; and the router's memory
of the prefixes it sent to each rank."""

from __future__ import annotations

from collections import OrderedDict, deque
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
    prefixes routed there since (those count as L1: the rank will hold them in L1). Short
    of one chunk (a short conversation: the digest holds chunk boundaries only), the
    deepest page of its first chunk among those the router sent there, as L1.

        [0, chunk) first chunk: page-granular (routed pages) | whole chunks (the digest)"""
    digest = rank.digest
    if digest is None or digest.version is None or not request.has_tokens:
        return NO_MATCH
    hashes = request.boundary_hashes(digest.namespace, digest.page_size, digest.chunk_size)
    match = digest.match(hashes, rank.routed_prefixes)
    if match.num_chunks == 0:
        pages = first_chunk_page_hashes(request, rank)
        num_tokens = deepest_present(pages, rank.routed_pages) * digest.page_size
        return PrefixEstimate(num_tokens, num_tokens)
    return PrefixEstimate(
        match.num_chunks * digest.chunk_size, match.num_l1_chunks * digest.chunk_size
    )


def deepest_present(page_hashes: Sequence[bytes], held: Mapping[bytes, object]) -> int:
    """The number of leading pages up to the deepest of `page_hashes` in `held`: a chained
    hash names its whole prefix, so a deeper page found stands for the pages before it."""
    for num_pages in range(len(page_hashes), 0, -1):
        if page_hashes[num_pages - 1] in held:
            return num_pages
    return 0


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


def first_chunk_page_hashes(request: RoutingRequest, rank: RankView) -> list[bytes]:
    """The hashes of the request's full pages in its first digest chunk (none without a
    digest), which `RoutedPages` remembers where the request is routed."""
    digest = rank.digest
    if digest is None or digest.version is None or not request.has_tokens:
        return []
    num_chunk_pages = digest.chunk_size // digest.page_size
    return request.page_hashes(digest.namespace, digest.page_size)[:num_chunk_pages]


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


# Page hashes remembered per rank: 16 pages of each of 4,096 conversations at the defaults
# (page 16, chunk 256); about 0.5 MB per rank.
MAX_ROUTED_PAGES = 65_536


class RoutedPages:
    """The page hashes of the first chunk of requests this router sent to one rank, least
    recently routed forgotten first; emptied when the rank's cache is reset. The digest
    holds chunk boundaries only, so a conversation shorter than one chunk is found by
    these (a guess: the rank may have evicted them since). Lives on the router's loop."""

    def __init__(self, max_pages: int = MAX_ROUTED_PAGES) -> None:
        self.pages: OrderedDict[bytes, None] = OrderedDict()
        self.max_pages = max_pages

    def add(self, page_hashes: Sequence[bytes]) -> None:
        for h in page_hashes:
            self.pages[h] = None
            self.pages.move_to_end(h)
        while len(self.pages) > self.max_pages:
            self.pages.popitem(last=False)
