"""The router's HTTP front door: the generation endpoints forwarded to a decode rank (with
the chosen prefill rank's URL), /v1/models[/{id}], /tokenize, /detokenize and /server_info
from a decode rank, /health, /get_load, /metrics and /version from the router's own view,
/flush_cache (and vLLM's /reset_prefix_cache) fanned out to all, and /workers
(membership.py), over the `RouterState` they share (state.py). A path that is not
canonical (`kvstrata/http/paths.py`) is a 404 before any route; the ranks get keys by the
path called (rank_keys.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect

from kvstrata.errors_text import describe_error
from kvstrata.http.errors import CLIENT_GONE, OpenAIError, error_body, install_error_handlers
from kvstrata.http.gates import add_gates
from kvstrata.http.middleware import (
    ROUTER_CLUSTER_PATHS,
    CanonicalPathMiddleware,
    ClusterKeyMiddleware,
)
from kvstrata.router import membership
from kvstrata.router.body import Outgoing, RelayBody, read_body, text_chars
from kvstrata.router.client_limit import ClientInflightLimit
from kvstrata.router.l3 import find_l3_matches
from kvstrata.router.launch_proof import make_launch_proof_router
from kvstrata.router.policy import RoutingRequest
from kvstrata.router.state import RouterState
from kvstrata.router.tokens import known_token_ids, request_token_ids
from kvstrata.router.workers import RankState, Role
from kvstrata.version import kvstrata_version

router = APIRouter()


def _state(request: Request) -> RouterState:
    return request.app.state.kvstrata_router


async def _forward(request: Request, path: str) -> Response:
    state = _state(request)
    try:
        outgoing = await _outgoing(state, request, path)
    except ClientDisconnect:
        return Response(status_code=CLIENT_GONE)
    return await state.forwarder.forward(request, path, outgoing)


async def _outgoing(state: RouterState, request: Request, path: str) -> Outgoing:
    """The body (read up to the limit) and what routing needs from it: the parsed body
    and its token ids live only in this frame. Text past the prompt character bound is
    not tokenized here (the rank refuses it); such a request routes by load alone."""
    assert state.config.max_body_bytes is not None  # set by RouterState.build
    body = await read_body(request, state.config.max_body_bytes)
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        parsed = None  # the rank answers the 400
    session = state.forwarder.sessions.session_of(request.headers, parsed, path)  # 400s first
    bounds = state.prompt_bounds
    if state.tokenizer is not None and (
        bounds is None or text_chars(parsed) <= bounds.max_prompt_chars
    ):
        tokens = await asyncio.to_thread(request_token_ids, state.tokenizer, path, parsed)
    else:
        tokens = known_token_ids(path, parsed)
    routing = RoutingRequest(tokens)
    routing.session = session
    if path == "/v1/responses" and isinstance(parsed, dict):
        previous = parsed.get("previous_response_id")
        routing.home_url = state.forwarder.homes.home_of(
            previous if isinstance(previous, str) else None
        )
    del parsed
    if tokens is not None and state.forwarder.policy.uses_digests:
        # Hash the prompt off the event loop, once per way the decode ranks hash.
        keys = {
            (r.digest.namespace, r.digest.page_size)
            for r in state.workers.decode
            if r.digest is not None and r.digest.page_size
        }
        for namespace, page_size in keys:
            await asyncio.to_thread(routing.page_hashes, namespace, page_size)
        if state.forwarder.policy.uses_l3:
            await find_l3_matches(state.client, state.workers.decode, routing)
    return Outgoing(RelayBody(body), routing)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _forward(request, "/v1/chat/completions")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _forward(request, "/v1/completions")


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    return await _forward(request, "/v1/responses")


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Response:
    return await _at_home(request, "GET", response_id)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    return await _at_home(request, "DELETE", response_id)


async def _at_home(request: Request, method: str, response_id: str) -> Response:
    """`method` /v1/responses/{id} at the decode rank that stored it (as the router
    learned when it relayed it), else at each healthy decode rank until one has it: a
    404 only once none has."""
    forwarder = _state(request).forwarder
    path = f"/v1/responses/{quote(response_id, safe='')}"
    home, found = await _first_holder(request, method, path, forwarder.homes.home_of(response_id))
    if home is not None:
        forwarder.homes.learn(response_id, home)
    return found


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> Response:
    return await _session_at_home(request, "GET", session_id, "")


@router.delete("/sessions/{session_id}")
async def close_session(session_id: str, request: Request) -> Response:
    answer = await _session_at_home(request, "DELETE", session_id, "")
    _state(request).forwarder.sessions.table.forget(session_id)
    return answer


@router.post("/sessions/{session_id}/prefetch")
async def prefetch_session(session_id: str, request: Request) -> Response:
    return await _session_at_home(request, "POST", session_id, "/prefetch")


async def _session_at_home(request: Request, method: str, session_id: str, tail: str) -> Response:
    """A rank's session endpoint at the session's home decode rank (where the router
    routed its last turn), else at the first healthy decode rank that knows it."""
    home = _state(request).forwarder.sessions.table.home_of(session_id)
    path = f"/sessions/{quote(session_id, safe='')}{tail}"
    _, found = await _first_holder(request, method, path, home.rank_url if home else None)
    return found


async def _first_holder(
    request: Request, method: str, path: str, home: str | None
) -> tuple[str | None, Response]:
    """`method` `path` at `home` first, then each healthy decode rank, until one answers
    other than 404: (that rank, its answer); (None, the last 404) when none has it."""
    state = _state(request)
    ranks = sorted(state.workers.decode, key=lambda rank: rank.url != home)
    answer: Response | None = None
    for rank in ranks:
        if not rank.healthy:
            continue
        try:
            response = await state.client.request(method, f"{rank.url}{path}")
        except httpx.HTTPError as e:
            state.forwarder.outcomes.failed(rank, method.lower(), e)
            continue
        content_type = response.headers.get("content-type", "application/json")
        answer = Response(response.content, response.status_code, {"content-type": content_type})
        if response.status_code != 404:
            return rank.url, answer
    if answer is None:
        raise OpenAIError(503, "no healthy decode rank", code="no_healthy_rank")
    return None, answer


@router.post("/generate")
async def generate(request: Request) -> Response:
    return await _forward(request, "/generate")


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    workers = _state(request).workers
    counts = {
        "num_healthy_prefill": workers.num_healthy(Role.PREFILL),
        "num_prefill": len(workers.prefill),
        "num_healthy_decode": workers.num_healthy(Role.DECODE),
        "num_decode": len(workers.decode),
    }
    if not workers.is_ready:
        body = error_body(503, "no healthy decode rank", code="no_healthy_rank")
        return JSONResponse(body | counts, status_code=503)
    # Serving, if degraded: with no healthy prefill rank the decode ranks prefill.
    status = "degraded: no healthy prefill rank" if workers.is_degraded else "ok"
    return JSONResponse({"status": status} | counts)


@router.get("/get_load")
async def get_load(request: Request) -> list[dict[str, Any]]:
    """Every rank as the router sees it: health, in-flight counts, the last polled load."""
    return [rank.to_json() for rank in _state(request).workers.ranks]


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = _state(request)
    return Response(state.metrics.render(state.workers), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    return await _from_decode_rank(request, "/v1/models")


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> Response:
    return await _from_decode_rank(request, f"/v1/models/{quote(model_id, safe='/')}")


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    return await _post_to_decode_rank(request, "/tokenize")


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    return await _post_to_decode_rank(request, "/detokenize")


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": kvstrata_version()}


async def _post_to_decode_rank(request: Request, path: str) -> Response:
    """The body (read up to the limit) posted to a decode rank, not routed: these paths
    hold no request for the policy to place."""
    limit = _state(request).config.max_body_bytes
    assert limit is not None  # set by RouterState.build
    try:
        body = await read_body(request, limit)
    except ClientDisconnect:
        return Response(status_code=CLIENT_GONE)
    return await _from_decode_rank(request, path, bytes(body))


@router.get("/server_info")
async def server_info(request: Request) -> dict[str, Any]:
    state = _state(request)
    config = {
        k: v
        for k, v in dataclasses.asdict(state.config).items()
        if "api_key" not in k and "cluster_key" not in k
    }
    keys_set = {
        "api_key_set": state.config.api_key is not None,
        "cluster_key_set": state.config.cluster_key is not None,
    }
    decode_info = None
    try:
        response = await _from_decode_rank(request, "/server_info")
        decode_info = json.loads(bytes(response.body)) if response.status_code == 200 else None
    except OpenAIError:
        pass  # no decode rank answers: the router's own part still does
    return {
        "role": "router",
        "load_balance_method": state.forwarder.policy.name,
        "router_config": config | keys_set,
        "ranks": [rank.to_json() for rank in state.workers.ranks],
        "decode_server_info": decode_info,
    }


@router.post("/reset_prefix_cache")  # vLLM's name (aiperf's --reset-kv-cache posts it)
@router.post("/flush_cache")
async def flush_cache(request: Request) -> JSONResponse:
    """Flush every rank (query string passed on, e.g. ?wait=true). 200 only if all did;
    409 if any refused (requests in flight); 400 if a rank found the request bad; 502 if
    any could not be reached."""
    state = _state(request)
    query = f"?{request.url.query}" if request.url.query else ""
    ranks = state.workers.ranks
    results = await asyncio.gather(*(_flush_one(state, rank, query) for rank in ranks))
    statuses = [r["status_code"] for r in results]
    if all(code == 200 for code in statuses):
        return JSONResponse({"flushed": True, "ranks": results})
    # A rank's 4xx (other than busy) means the request itself was bad, e.g. ?wait=maybe.
    client_error = any(code is not None and 400 <= code < 500 for code in statuses)
    status = 409 if 409 in statuses else 400 if client_error else 502
    failed = ", ".join(
        f"{r['url']} ({r['status_code'] or r['error']})" for r in results if r["status_code"] != 200
    )
    body = error_body(status, f"not every rank flushed its cache: {failed}", code="flush_failed")
    return JSONResponse(body | {"flushed": False, "ranks": results}, status_code=status)


async def _flush_one(state: RouterState, rank: RankState, query: str) -> dict[str, Any]:
    result: dict[str, Any] = {"role": rank.role.value, "index": rank.index, "url": rank.url}
    try:
        response = await state.client.post(f"{rank.url}/flush_cache{query}")
    except httpx.HTTPError as e:
        state.forwarder.outcomes.failed(rank, "flush", e)
        return result | {"status_code": None, "error": describe_error(e)}
    return result | {"status_code": response.status_code, "error": None}


async def _from_decode_rank(request: Request, path: str, body: bytes | None = None) -> Response:
    """GET `path` (POST `body` as JSON, if given) from the first healthy decode rank that
    answers."""
    state = _state(request)
    for rank in state.workers.decode:
        if not rank.healthy:
            continue
        try:
            if body is None:
                response = await state.client.get(f"{rank.url}{path}")
            else:
                headers = {"content-type": "application/json"}
                response = await state.client.post(
                    f"{rank.url}{path}", content=body, headers=headers
                )
        except httpx.HTTPError as e:
            state.forwarder.outcomes.failed(rank, "get" if body is None else "post", e)
            continue
        content_type = response.headers.get("content-type", "application/json")
        return Response(response.content, response.status_code, {"content-type": content_type})
    raise OpenAIError(503, "no healthy decode rank", code="no_healthy_rank")


def build_router_app(state: RouterState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.inquirer.poll_once()  # serve with real health from the first request
        state.inquirer.start()
        state.membership.start()
        try:
            yield
        finally:
            await state.membership.stop()
            await state.inquirer.stop()
            await state.client.aclose()
            await asyncio.to_thread(state.forwarder.tracer.shutdown)  # export what is left

    app = FastAPI(
        title="kvstrata router",
        summary="Routes requests to kvstrata prefill and decode ranks.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.kvstrata_router = state
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(membership.router)
    app.include_router(make_launch_proof_router(state.config))
    app.add_middleware(  # inside the gates: only key holders count
        ClientInflightLimit,
        max_inflight=state.config.max_inflight_per_client,
        by_api_key=state.config.api_key is not None,
        on_refused=state.metrics.client_limited.inc,
    )
    add_gates(app, state.config)  # connection rate, API key and body size, as on ranks
    # Run before those: /workers is keyed before its body is read, and a path that could
    # name another endpoint at a rank (`/v1/models/%2e%2e/...`) is a 404, never forwarded.
    app.add_middleware(
        ClusterKeyMiddleware,
        cluster_key=state.config.cluster_key,
        paths=ROUTER_CLUSTER_PATHS,
        guards_prefill_url=False,
    )
    app.add_middleware(CanonicalPathMiddleware)
    return app
