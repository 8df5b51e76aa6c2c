"""Admin endpoints of a rank's cache tiers: `POST /hicache/storage/clear` empties this
model's pages from L3 (`/flush_cache` drops L1 and L2 but never L3)."""

from __future__ import annotations

from fastapi import APIRouter

from kvstrata.server.errors import OpenAIError
from kvstrata.server.state import StateDep

router = APIRouter()


@router.post("/hicache/storage/clear")
async def clear_storage(state: StateDep) -> dict[str, int]:
    num_pages = await state.engine_loop.call(lambda engine: engine.tiers.clear_l3())
    if num_pages is None:
        raise OpenAIError(400, "this rank has no L3 storage (--hicache-storage-backend)")
    return {"num_deleted_pages": num_pages}
