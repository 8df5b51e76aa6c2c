"""`DecodePeerWatch`: a decode rank's watch over the prefill ranks its rooms are waiting on.
While a prefill rank holds rooms of this rank, its `/health` is asked every quarter of
`answer_timeout_s`; a rank that does not answer within `answer_timeout_s` (frozen, or
gone) is reported to every room waiting on it, which then follows the failure policy
instead of waiting out the whole transfer timeout."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from kvstrata.errors_text import describe_error


@dataclass
class Watched:
    """One prefill rank under watch: the rooms waiting on it, its probe, its verdict."""

    num_rooms: int = 0
    unresponsive: asyncio.Event = field(default_factory=asyncio.Event)
    why: str = ""
    probe: asyncio.Task[None] | None = None


class DecodePeerWatch:
    """Lives on the event loop. `watching(url)` is held by a room for as long as it waits
    on `url`; its event fires once `url` stopped answering. A verdict lasts until no room
    waits on the rank any more: the next room starts a fresh watch."""

    def __init__(self, client: httpx.AsyncClient, answer_timeout_s: float) -> None:
        self._client = client
        self.answer_timeout_s = answer_timeout_s
        self._ranks: dict[str, Watched] = {}
        self.num_unresponsive = 0  # verdicts given, for /metrics

    @contextlib.asynccontextmanager
    async def watching(self, url: str) -> AsyncIterator[Watched]:
        watched = self._ranks.get(url)
        if watched is None:
            watched = self._ranks[url] = Watched()
            watched.probe = asyncio.ensure_future(self._probe(url, watched))
        watched.num_rooms += 1
        try:
            yield watched
        finally:
            watched.num_rooms -= 1
            if watched.num_rooms == 0 and self._ranks.get(url) is watched:
                del self._ranks[url]
                if watched.probe is not None:
                    watched.probe.cancel()

    async def _probe(self, url: str, watched: Watched) -> None:
        """Ask `url` for /health until it fails to answer in time. Any answer counts as
        alive (a 503 rank still answers its rooms, with an error); only silence and refused
        connections do not."""
        interval_s = self.answer_timeout_s / 4
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self._client.get(f"{url}/health", timeout=self.answer_timeout_s)
            except httpx.HTTPError as e:
                watched.why = (
                    f"prefill rank {url} did not answer /health within "
                    f"{self.answer_timeout_s:g} s ({describe_error(e)})"
                )
                self.num_unresponsive += 1
                watched.unresponsive.set()
                return

    async def close(self) -> None:
        probes = [w.probe for w in self._ranks.values() if w.probe is not None]
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        self._ranks.clear()
