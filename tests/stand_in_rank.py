"""A stand-in rank for router tests: a tiny HTTP server on a free loopback port that
answers `GET /get_load` and `GET /health` like a rank, either of which can be made to hang
(as a busy prefill rank's /get_load does) until released; it counts the requests."""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LOAD = {
    "rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_queued_tokens": 0,
    "num_free_pages": 64, "num_cached_pages": 0, "num_used_pages": 0, "num_total_pages": 64,
}  # fmt: skip
_HANG_LIMIT_S = 60.0  # a hung request ends by itself after this long at the latest


class StandInRank:
    """`hang` holds the paths whose requests block until `release()` (or the limit);
    `health_status` is what /health answers."""

    def __init__(self, hang: tuple[str, ...] = ()) -> None:
        self.hang = set(hang)
        self.health_status = 200
        self.requests: Counter[str] = Counter()
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def count(self, path: str) -> int:
        with self._lock:
            return self.requests[path]

    def release(self) -> None:
        self._released.set()

    def __enter__(self) -> StandInRank:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, path: str) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.requests[path] += 1
        if path in self.hang:
            self._released.wait(_HANG_LIMIT_S)
        if path == "/get_load":
            return 200, LOAD
        if path == "/health":
            return self.health_status, {"status": "ok" if self.health_status == 200 else "down"}
        return 404, {"error": {"message": f"no {path}", "type": "not_found_error"}}

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        rank = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                status, body = rank._answer(self.path.split("?")[0])
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the caller timed out and left

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler
