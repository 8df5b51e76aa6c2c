"""The staging control channel's wire format, shared by the decode rank's staging server
and its senders: `<II`-sized JSON frames with raw bytes, strictly checked message fields,
and the hello MAC that proves a sender holds the staging secret."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
import time
from collections.abc import Mapping
from typing import Any

SECRET_BYTES = 32
_HEADER = struct.Struct("<II")  # header JSON bytes, payload bytes
MAX_HEADER_BYTES = 1024  # every control header is a few small fields
_HELLO = b"kvstrata-staging-hello\x00"  # what a sender's MAC covers, with both nonces


class ControlError(RuntimeError):
    """The control channel broke, timed out, or carried something malformed or refused."""


# ---- framing: `<II` sizes, a JSON object, raw bytes; sizes are checked before reading ----


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    """One message: a JSON header and raw bytes (int64 item ids for a scatter)."""
    head = json.dumps(header).encode()
    sock.sendall(_HEADER.pack(len(head), len(payload)) + head + payload)


def recv_frame(
    sock: socket.socket,
    max_payload_bytes: int,
    idle_s: float | None = None,
    message_s: float | None = None,
) -> tuple[dict[str, Any], bytes]:
    """One message. Without limits, the socket's own timeout applies to each read; with
    them (the server), the first byte must come within `idle_s` and the whole message
    within `message_s` after it, so a slow or silent peer cannot hold a reader."""
    if idle_s is not None:
        sock.settimeout(idle_s)
    first = _recv_exact(sock, 1, None)
    deadline_s = None if message_s is None else time.monotonic() + message_s
    head_bytes, payload_bytes = _HEADER.unpack(first + _recv_exact(sock, 7, deadline_s))
    if head_bytes > MAX_HEADER_BYTES or payload_bytes > max_payload_bytes:
        raise ControlError(f"oversized control frame ({head_bytes} + {payload_bytes} bytes)")
    try:
        header = json.loads(_recv_exact(sock, head_bytes, deadline_s))
    except (ValueError, RecursionError) as e:
        raise ControlError(f"malformed control header: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise ControlError("the control header is not an object")
    return header, _recv_exact(sock, payload_bytes, deadline_s)


def _recv_exact(sock: socket.socket, num_bytes: int, deadline_s: float | None) -> bytes:
    chunks, left = [], num_bytes
    try:
        while left:
            if deadline_s is not None:
                remaining_s = deadline_s - time.monotonic()
                if remaining_s <= 0:
                    raise ControlError("a control message did not arrive in time")
                sock.settimeout(remaining_s)
            chunk = sock.recv(min(left, 1 << 20))
            if not chunk:
                raise ControlError("the control connection closed")
            chunks.append(chunk)
            left -= len(chunk)
    except TimeoutError:
        raise ControlError("the control connection timed out") from None
    return b"".join(chunks)


def fields(header: dict[str, Any], op: str, types: Mapping[str, type]) -> dict[str, Any]:
    """`header` as message `op`: exactly these keys (plus "op"), each of its type (an int is
    never a bool); raises ControlError naming the first bad field."""
    if header.get("op") != op:
        raise ControlError(f"expected a {op!r} message, got {str(header.get('op'))[:32]!r}")
    if set(header) != {"op", *types}:
        raise ControlError(f"{op}: fields must be {sorted(types)}")
    for name, expected in types.items():
        value = header[name]
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ControlError(f"{op}: {name} must be a {expected.__name__}")
    return header


def hello_mac(secret: bytes, server_nonce: str, client_nonce: str, peer: str) -> str:
    """What proves a sender holds the secret: an HMAC over both nonces and its name."""
    message = _HELLO + f"{server_nonce}\x00{client_nonce}\x00{peer}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def parse_nonce(value: str) -> str:
    if len(value) != 2 * SECRET_BYTES or value.strip("0123456789abcdef"):
        raise ControlError("a nonce must be 64 lowercase hex digits")
    return value
