"""Gates every HTTP request passes before routing: a canonical path (404, the router), the
API key (401), the cluster key of rank-to-rank paths and headers (401, before any query or
body is read) and the body size limit (413). Plain ASGI, so streaming responses pass
through untouched."""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvstrata.http.errors import error_body
from kvstrata.http.paths import path_problem

# /launch_proof (the router's, router/launch_proof.py): its answer reveals no key, and
# `kvstrata launch` must not send a key to a server it has not yet proven to be its own.
PUBLIC_PATHS = frozenset({"/health", "/launch_proof"})
# Paths a rank offers only to the ranks and the router of its cluster (docs/reliability.md,
# "Trust model"), each with what lies under it; a caller proves it belongs with
# CLUSTER_KEY_HEADER. The router's own such paths: ROUTER_CLUSTER_PATHS.
RANK_ONLY_PATHS = ("/pd", "/kv_events", "/hicache/storage/exists")
ROUTER_CLUSTER_PATHS = ("/workers",)
CLUSTER_KEY_HEADER = "X-Kvstrata-Cluster-Key"
# A decode rank takes the prefill rank it is told of only from the router (prefill_url.py).
PREFILL_URL_HEADER = "X-Kvstrata-Prefill-Url"
# The client a request counts against on a rank (its in-flight bound), named by the router
# and taken only from a caller holding the cluster key.
CLIENT_HEADER = "X-Kvstrata-Client"
_CLUSTER_KEY_HEADER_RAW = CLUSTER_KEY_HEADER.lower().encode()
_PREFILL_URL_HEADER_RAW = PREFILL_URL_HEADER.lower().encode()


def is_under(path: str, roots: tuple[str, ...]) -> bool:
    """Whether `path` is one of `roots` or lies under one (`/pd/prefill` under `/pd`)."""
    return any(path == root or path.startswith(f"{root}/") for root in roots)


def holds_cluster_key(headers: list[tuple[bytes, bytes]], cluster_key: str | None) -> bool:
    """Whether raw ASGI `headers` carry `cluster_key` (never true when there is none)."""
    if cluster_key is None:
        return False
    given = dict(headers).get(_CLUSTER_KEY_HEADER_RAW, b"")
    return hmac.compare_digest(given, cluster_key.encode())


async def send_error(
    send: Send,
    status_code: int,
    message: str,
    code: str,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> None:
    body = json.dumps(error_body(status_code, message, param, code)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status_code, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    """Every path but PUBLIC_PATHS needs `Authorization: Bearer <api_key>`, except that a
    request to one of `cluster_key_prefixes` holding the cluster key passes (a rank's
    call to a router, e.g. registering: ranks do not know the clients' key; the route
    checks the cluster key again)."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str,
        cluster_key_prefixes: tuple[str, ...] = (),
        cluster_key: str | None = None,
    ) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._cluster_key_prefixes = cluster_key_prefixes
        self._cluster_key = cluster_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] in PUBLIC_PATHS
            or (
                self._cluster_key_prefixes
                and scope["path"].startswith(self._cluster_key_prefixes)
                and holds_cluster_key(scope["headers"], self._cluster_key)
            )
        ):
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self._expected):
            await send_error(
                send,
                401,
                "missing or invalid API key (send 'Authorization: Bearer KEY')",
                "invalid_api_key",
                {"www-authenticate": "Bearer"},
            )
            return
        await self.app(scope, receive, send)


class ClusterKeyMiddleware:
    """`paths` (and what lies under them) need CLUSTER_KEY_HEADER with the cluster key, and
    on a rank (`guards_prefill_url`) so does a request naming a prefill rank
    (PREFILL_URL_HEADER): checked here, so no query or body is read before the key. A
    process started without one (a standalone `kvstrata serve`) refuses them to everyone."""

    def __init__(
        self,
        app: ASGIApp,
        cluster_key: str | None,
        paths: tuple[str, ...] = RANK_ONLY_PATHS,
        guards_prefill_url: bool = True,
    ) -> None:
        self.app = app
        self.cluster_key = cluster_key
        self.paths = paths
        self.guards_prefill_url = guards_prefill_url

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or holds_cluster_key(scope["headers"], self.cluster_key):
            await self.app(scope, receive, send)
            return
        if is_under(scope["path"], self.paths):
            reason = (
                "this process has no cluster key (--cluster-key-file): it serves no "
                "rank-to-rank calls"
                if self.cluster_key is None
                else f"missing or invalid cluster key (send {CLUSTER_KEY_HEADER})"
            )
            await send_error(
                send, 401, f"{scope['path']} is rank-to-rank only: {reason}", "invalid_cluster_key"
            )
            return
        if (
            self.guards_prefill_url
            and scope["path"] not in PUBLIC_PATHS
            and any(name == _PREFILL_URL_HEADER_RAW for name, _ in scope["headers"])
        ):
            await send_error(
                send,
                401,
                f"{PREFILL_URL_HEADER} is taken only from the router (a caller "
                f"sending the cluster key in {CLUSTER_KEY_HEADER})",
                "invalid_cluster_key",
                param=PREFILL_URL_HEADER,
            )
            return
        await self.app(scope, receive, send)


class CanonicalPathMiddleware:
    """404 for a path that is not canonical (`path_problem`: dot or empty segments, an
    encoded `.` or `/`, backslashes), before any route or key check: the router forwards
    parts of paths to ranks, and such a path could name another endpoint there."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            raw_path = scope.get("raw_path") or scope["path"].encode()
            problem = path_problem(raw_path)
            if problem is not None:
                shown = raw_path[:200].decode("latin-1")
                await send_error(send, 404, f"no such path: {shown!r} has {problem}", "not_found")
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuse bodies over the limit with 413 as they arrive: a declared length up front,
    any other body counted chunk by chunk as the app reads it (nothing is buffered here:
    the router relays bodies, the JSON routes read them once). Once refused, the app's
    receive() reports a disconnect and whatever it still sends is dropped.

    `max_body_bytes` None: a rank's derived limit (what its longest allowed prompt
    needs, `RequestLimits.prompt_bounds`), read from the state `build_app` attached."""

    def __init__(self, app: ASGIApp, max_body_bytes: int | None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _limit_bytes(self, scope: Scope) -> int:
        if self.max_body_bytes is None:
            state = scope["app"].state.kvstrata  # a rank's ServerState
            self.max_body_bytes = state.limits.prompt_bounds(state.config).max_body_bytes
        return self.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit_bytes = self._limit_bytes(scope)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
            await self._too_large(send, limit_bytes)
            return
        num_bytes = 0
        refused = started = False

        async def counting_receive() -> Message:
            nonlocal num_bytes, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > limit_bytes:
                    refused = True
                    if not started:
                        await self._too_large(send, limit_bytes)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out; the app's answer to its "disconnect" goes nowhere
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counting_receive, guarded_send)

    @staticmethod
    async def _too_large(send: Send, limit_bytes: int) -> None:
        await send_error(
            send,
            413,
            f"the request body exceeds {limit_bytes} bytes (--max-body-bytes; by "
            "default what the longest prompt --max-prompt-tokens allows needs)",
            "request_too_large",
            {"connection": "close"},
        )
