"""Admin endpoints of a rank's cache tiers: `POST /hicache/storage/clear` empties this
model's pages from L3 (`/flush_cache` drops L1 and L2 but never L3), and
`POST /hicache/storage/exists` (rank-to-rank) answers how many leading pages of a chain
the L3 store holds, for L3-aware routing."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvstrata.http.errors import OpenAIError
from kvstrata.http.middleware import CLUSTER_KEY_HEADER, holds_cluster_key
from kvstrata.server.l3_index import L3Index
from kvstrata.server.state import StateDep

router = APIRouter()
MAX_EXISTS_PAGES = 8192  # a chain longer than any context of 16-token pages


@router.post("/hicache/storage/clear")
async def clear_storage(state: StateDep) -> dict[str, int]:
    num_pages = await state.engine_loop.run(state.engine_loop.engine.tiers.clear_l3)
    if num_pages is None:
        raise OpenAIError(400, "this rank has no L3 storage (--hicache-storage-backend)")
    return {"num_deleted_pages": num_pages}


class ExistsRequest(BaseModel):
    """A request's chained page hashes (hex), in order."""

    model_config = ConfigDict(extra="forbid", strict=True)

    page_hashes: list[str] = Field(max_length=MAX_EXISTS_PAGES)

    @field_validator("page_hashes")
    @classmethod
    def _hex_hashes(cls, hashes: list[str]) -> list[str]:
        for item in hashes:
            if len(item) != 64 or any(c not in "0123456789abcdef" for c in item):
                raise ValueError(f"a page hash is 64 lowercase hex digits, got {item[:80]!r}")
        return hashes


def _l3_index(request: Request, state: StateDep) -> L3Index:
    """The cluster key (checked first at the door, ClusterKeyMiddleware: FastAPI parses a
    JSON body before dependencies run), then the store."""
    if not holds_cluster_key(request.scope["headers"], state.config.cluster_key):
        raise OpenAIError(
            401,
            f"{request.url.path} is rank-to-rank only: send {CLUSTER_KEY_HEADER}",
            code="invalid_cluster_key",
        )
    index: L3Index | None = request.app.state.kvstrata_l3
    if index is None:
        raise OpenAIError(400, "this rank has no L3 storage (--hicache-storage-backend)")
    return index


@router.post("/hicache/storage/exists")
async def storage_exists(
    body: ExistsRequest, index: Annotated[L3Index, Depends(_l3_index)]
) -> dict[str, int | str]:
    hashes = [bytes.fromhex(item) for item in body.page_hashes]
    num_pages = await asyncio.to_thread(index.num_leading_pages, hashes)
    return {"num_pages": num_pages, "store": index.store_id}
