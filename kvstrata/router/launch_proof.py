"""`GET /launch_proof?challenge=C`: the router's proof, to the `kvstrata launch` that
started it, that it is the server on its port: the HMAC of C under the key of its
--launch-proof-key-file (kvstrata/cluster/port_owner.py). Public: the answer reveals no key."""

from __future__ import annotations

import re

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from kvstrata.config import RouterConfig
from kvstrata.config.options import flag, read_key_file
from kvstrata.http.errors import error_response
from kvstrata.http.launch_proof import LAUNCH_PROOF_PATH, launch_proof

# A challenge is fresh random hex from the launcher; anything else is refused unhashed.
_CHALLENGE = re.compile(r"[0-9a-f]{16,128}")


def make_launch_proof_router(config: RouterConfig) -> APIRouter:
    """The route, with the key read once from --launch-proof-key-file (a router without
    one answers 404: nobody launched it). Raises ConfigError for an unreadable file."""
    key = None
    if config.launch_proof_key_file is not None:
        key = read_key_file(config.launch_proof_key_file, flag("launch_proof_key_file"))
    router = APIRouter()

    @router.get(LAUNCH_PROOF_PATH)
    async def prove(challenge: str = "") -> Response:
        if key is None:
            message = "this router has no --launch-proof-key-file (kvstrata launch sets it)"
            return error_response(404, message, code="no_launch_proof")
        if not _CHALLENGE.fullmatch(challenge):
            message = "challenge must be 16 to 128 lowercase hex digits"
            return error_response(400, message, param="challenge", code="invalid_challenge")
        return JSONResponse({"proof": launch_proof(key, challenge)})

    return router
