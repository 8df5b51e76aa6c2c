"""A real router in front of a recording stand-in rank: a path that could mean another
endpoint at the rank once decoded or normalised (`/v1/models/%2e%2e/%2e%2e/debug/
invariants`, double encoding, backslashes, `//`) is a 404 and never forwarded, and the
router's own calls carry only the keys each path needs (issue 27, finding 3)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from cluster_key import TEST_CLUSTER_KEY
from server_harness import _free_port, spawn
from stand_in_rank import LOAD

from kvstrata.http.middleware import CLUSTER_KEY_HEADER
from kvstrata.http.paths import path_problem

CLIENT_KEY = "client-key-7e1"
RANK_KEY = "rank-key-41c"
RANK_ONLY = ("debug/invariants", "metrics", "get_load", "server_info", "kv_events")
# Each would reach a rank-only endpoint if decoded and normalised before forwarding.
TRICKS = [
    *(f"/v1/models/%2e%2e/%2e%2e/{path}" for path in RANK_ONLY),
    "/v1/models/%2E%2E/%2E%2E/debug/invariants",
    "/v1/models/../../debug/invariants",
    "/v1/models/x/../../../metrics",
    "/v1/models/./../../kv_events",
    "/v1/models/%252e%252e/%252e%252e/debug/invariants",  # decoded twice
    "/v1/models/..%2f..%2fdebug%2finvariants",
    "/v1/models/..%5c..%5cget_load",
    "/v1/models/..\\..\\server_info",
    "/v1/models//../../kv_events",
    "/v1//models/%2e%2e/kv_events",
    "//debug/invariants",
    "/v1/models/%2e%2e%2f%2e%2e%2fmetrics",
]


class RecordingRank:
    """A stand-in decode rank that records every request: the target as sent and its
    headers. It answers /get_load and /health like a rank, 404 to /kv_events (the router
    then polls), and 200 with the path to anything else."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, str]]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def requests_to(self, path: str) -> list[dict[str, str]]:
        with self._lock:
            return [headers for target, headers in self.seen if target.split("?")[0] == path]

    def targets(self) -> set[str]:
        with self._lock:
            return {target.split("?")[0] for target, _ in self.seen}

    def __enter__(self) -> RecordingRank:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        rank = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                with rank._lock:
                    rank.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                path = self.path.split("?")[0]
                status, body = 200, {"reached": path, "id": path, "object": "model"}
                if path == "/get_load":
                    body = LOAD
                elif path == "/health":
                    body = {"status": "ok"}
                elif path == "/kv_events":
                    status, body = 404, {"error": {"message": "no /kv_events", "type": "x"}}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


def wait_for(url: str, condition: Any, timeout_s: float = 60.0, **options: Any) -> Any:
    """GET `url` until `condition(json)` holds (bounded); that json."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        try:
            body = httpx.get(url, timeout=5, **options).json()
            if condition(body):
                return body
        except (httpx.TransportError, ValueError):
            body = None
        assert time.monotonic() < deadline_s, f"{url} never satisfied the condition: {body}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RecordingRank, str]]:
    logs = tmp_path_factory.mktemp("router-paths")
    keys = {}
    for name, key in (("client", CLIENT_KEY), ("rank", RANK_KEY)):
        keys[name] = logs / f"{name}.key"
        keys[name].write_text(key)
        keys[name].chmod(0o600)
    with RecordingRank() as rank:
        router = spawn(logs / "router.log", _free_port(), "router", "--decode", rank.url,
                       "--api-key-file", str(keys["client"]),
                       "--rank-api-key-file", str(keys["rank"]))  # fmt: skip
        try:
            wait_for(f"{router.base_url}/health", lambda body: body.get("status") == "ok")
            yield rank, router.base_url
        finally:
            assert router.stop() == 0, router.log()


def raw_get(base_url: str, target: str) -> int:
    """The status of `GET target` sent byte for byte (httpx would normalise it)."""
    port = int(base_url.rsplit(":", 1)[1])
    head = f"GET {target} HTTP/1.1\r\nHost: router\r\nAuthorization: Bearer {CLIENT_KEY}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode() + b"Connection: close\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def test_traversal_paths_are_404_and_never_forwarded(routed: tuple[RecordingRank, str]) -> None:
    rank, router_url = routed
    for target in TRICKS:
        assert raw_get(router_url, target) == 404, target
    # Forwarded paths still work, model ids with slashes and dots included.
    for model_id in ("tiny", "org/model-1.5"):
        assert raw_get(router_url, f"/v1/models/{model_id}") == 200, model_id
    assert rank.targets() <= {"/get_load", "/health", "/kv_events", "/v1/models/tiny",
                              "/v1/models/org/model-1.5"}, rank.targets()  # fmt: skip


def test_the_router_sends_each_rank_path_only_the_keys_it_needs(
    routed: tuple[RecordingRank, str],
) -> None:
    rank, router_url = routed
    assert raw_get(router_url, "/v1/models/tiny") == 200
    answer = httpx.get(f"{router_url}/v1/models/tiny", headers={"authorization": "Bearer no"})
    assert answer.status_code == 401  # the client key guards the router itself
    polled = wait_for(f"{router_url}/get_load", lambda ranks: ranks and ranks[0]["healthy"],
                      timeout_s=30, headers={"authorization": f"Bearer {CLIENT_KEY}"})  # fmt: skip
    assert polled
    for path in ("/get_load", "/v1/models/tiny"):
        for headers in rank.requests_to(path):
            assert headers.get("authorization") == f"Bearer {RANK_KEY}", path
            assert CLUSTER_KEY_HEADER.lower() not in headers, path  # no rank-only path
    subscriptions = rank.requests_to("/kv_events")
    assert subscriptions, "the router subscribes to the rank's events"
    for headers in subscriptions:
        assert headers.get(CLUSTER_KEY_HEADER.lower()) == TEST_CLUSTER_KEY


def test_path_problems_name_what_is_wrong() -> None:
    assert path_problem(b"/v1/models/org/model-1.5") is None
    assert path_problem(b"/v1/models/") is None  # a trailing slash normalises to itself
    for raw in (b"/a/%2e%2e/b", b"/a/%2F", b"/a/%5c", b"/a/%252e", b"/a/%00"):
        assert path_problem(raw) == "an encoded '.', '/', '\\' or '%'", raw
    assert path_problem(b"/a/../b") == "a '.' or '..' segment"
    assert path_problem(b"/a/./b") == "a '.' or '..' segment"
    assert path_problem(b"/a//b") == "an empty segment ('//')"
    assert path_problem(b"/a\\b") == "a backslash"
    assert path_problem(b"/a/%0a") == "a control character"
    assert path_problem(b"a/b") == "no leading '/'"
