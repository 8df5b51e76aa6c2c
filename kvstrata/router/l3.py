"""L3-aware routing, the router's side: which L3 store each decode rank restores from
(the `l3_store` of its pushed load) and how many leading pages of a request each store
holds, asked of one rank per store (`POST /hicache/storage/exists`, the store's own
index) before the policy decides. A prefix in a shared store can be restored on any rank
that reads that store, at L3's cost instead of a prefill."""

from __future__ import annotations

import asyncio
import logging

import httpx

from kvstrata.errors_text import describe_error
from kvstrata.router.policy import RoutingRequest, l3_store_of
from kvstrata.router.rank_state import RankState

logger = logging.getLogger("kvstrata.router")
# A store that does not answer this fast is taken to hold nothing: routing must not wait
# on storage longer than a prefill of a short prompt.
EXISTS_TIMEOUT_S = 0.5


async def find_l3_matches(
    client: httpx.AsyncClient, ranks: list[RankState], request: RoutingRequest
) -> None:
    """Fill `request.l3_pages` ({store id: leading pages held}) for the stores of the
    healthy `ranks` that have a digest (its namespace and page size hash the request)."""
    askers: dict[str, RankState] = {}
    for rank in ranks:
        store = l3_store_of(rank.load)
        if (
            store is not None
            and rank.healthy
            and rank.digest is not None
            and (rank.digest.page_size)
        ):
            askers.setdefault(store, rank)
    if not askers or not request.has_tokens:
        return
    stores = list(askers)
    counts = await asyncio.gather(*(_ask(client, askers[s], request) for s in stores))
    request.l3_pages.update(zip(stores, counts))


async def _ask(client: httpx.AsyncClient, rank: RankState, request: RoutingRequest) -> int:
    assert rank.digest is not None
    hashes = request.page_hashes(rank.digest.namespace, rank.digest.page_size)
    if not hashes:
        return 0
    try:
        response = await client.post(
            f"{rank.url}/hicache/storage/exists",
            json={"page_hashes": [h.hex() for h in hashes]},
            timeout=EXISTS_TIMEOUT_S,
        )
        if response.status_code != 200:
            raise ValueError(f"answered {response.status_code}: {response.text[:200]}")
        num_pages = response.json()["num_pages"]
        if not isinstance(num_pages, int) or not 0 <= num_pages <= len(hashes):
            raise ValueError(f"num_pages out of range: {num_pages!r}")
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        logger.debug(
            "%s: L3 lookup failed (%s); counting no L3 pages",
            rank.name,
            describe_error(e, qualified=True),
        )
        return 0
    return num_pages
