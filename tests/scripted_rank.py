"""A stand-in rank whose generation answers are scripted by body, for router tests in real
processes: a `StandInRank` (its /get_load and /health answer like a rank's) that also takes
POSTs, records each body and answers as `script(path, body)` says: a JSON answer, a
connection dropped after the whole body was read (as a rank killed holding the request),
a large JSON answer written in slices, or an answer held until `release()`."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from stand_in_rank import StandInRank

_HOLD_LIMIT_S = 60.0  # a held answer goes out by itself after this long at the latest
_SLICE_BYTES = 1 << 20


@dataclass(frozen=True)
class Answer:
    """`status` and `body` (JSON, or bytes as they are), sent after `release_held()` if
    `hold`."""

    status: int = 200
    body: Any = None
    hold: bool = False
    content_type: str = "application/json"


@dataclass(frozen=True)
class Drop:
    """Close the connection once the body is read, answering nothing."""


@dataclass(frozen=True)
class Large:
    """A 200 JSON answer of `num_bytes` (a `text` of that length, then a `usage`); with
    `cut_after`, the connection is closed once that many bytes of it went out."""

    num_bytes: int
    cut_after: int | None = None


Script = Callable[[str, bytes], Answer | Drop | Large]


class ScriptedRank(StandInRank):
    def __init__(self, script: Script) -> None:
        super().__init__()
        self.script = script
        self.bodies: list[bytes] = []  # every POST body, in arrival order
        self.post_headers: list[dict[str, str]] = []  # and its headers (names lower case)
        self._held = threading.Event()

    def release_held(self) -> None:
        self._held.set()

    def posts(self) -> list[bytes]:
        with self._lock:
            return list(self.bodies)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        rank = self
        base = super()._handler_class()

        class Handler(base):  # type: ignore[misc, valid-type]
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with rank._lock:
                    rank.bodies.append(body)
                    rank.post_headers.append({k.lower(): v for k, v in self.headers.items()})
                action = rank.script(self.path.split("?")[0], body)
                try:
                    if isinstance(action, Drop):
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                    elif isinstance(action, Large):
                        self._send_large(action.num_bytes, action.cut_after)
                    else:
                        if action.hold:
                            rank._held.wait(_HOLD_LIMIT_S)
                        data = (
                            action.body
                            if isinstance(action.body, bytes)
                            else (json.dumps(action.body).encode())
                        )
                        self._start(action.status, len(data), action.content_type)
                        self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError, OSError):
                    pass  # the router left

            def _start(self, status: int, num_bytes: int, content_type: str) -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(num_bytes))
                self.end_headers()

            def _send_large(self, num_bytes: int, cut_after: int | None) -> None:
                head, tail = b'{"text": "', b'", "usage": ' + json.dumps(USAGE).encode() + b"}"
                num_text_bytes = num_bytes - len(head) - len(tail)
                self._start(200, num_bytes, "application/json")
                self.wfile.write(head)
                piece = b"a" * _SLICE_BYTES
                for start in range(0, num_text_bytes, _SLICE_BYTES):
                    if cut_after is not None and start >= cut_after:
                        self.wfile.flush()
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    self.wfile.write(piece[: min(_SLICE_BYTES, num_text_bytes - start)])
                self.wfile.write(tail)

        return Handler


USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
         "kvstrata": {"cached_tokens_l1": 2, "cached_tokens_l2": 0, "cached_tokens_l3": 0,
                      "rank": 0}}  # fmt: skip


def error(status: int, message: str, code: str) -> Answer:
    """An OpenAI error answer."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return Answer(status, body)
