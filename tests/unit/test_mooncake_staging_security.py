"""The staging control server against hostile callers (real sockets): without the secret
nothing is leased or scattered; every malformed, out-of-range, oversized, truncated or slow
message closes that connection alone and a good sender is served right after; one peer's
links and leases are bounded; the secret stays out of reprs and error messages."""

from __future__ import annotations

import dataclasses
import json
import secrets
import socket
import struct
import time
from collections.abc import Iterator

import pytest
import torch
from test_mooncake_transport import SENTINEL, make_pool

from kvstrata.disagg.transport.base import TransferError
from kvstrata.disagg.transport.mooncake import MooncakeReceiver, MooncakeSender
from kvstrata.disagg.transport.mooncake_coalesce import StagingLink
from kvstrata.disagg.transport.mooncake_control import (
    ControlError,
    hello_mac,
    recv_frame,
    send_frame,
)
from kvstrata.disagg.transport.mooncake_staging import (
    SLOTS_PER_LINK,
    StagingInfo,
    StagingLimits,
    StagingServer,
    pool_items,
)

NUM_PAGES, NUM_SLOTS, SLOT_BYTES = 8, 8, 4096  # 48 pool items of 256 bytes; 16 per slot
LIMITS = StagingLimits(
    quarantine_s=0.05, message_s=0.5, idle_s=1.0, max_links=4, max_links_per_peer=2,
    max_pending=3,
)  # fmt: skip


class Server:
    def __init__(self) -> None:
        self.pool = make_pool(NUM_PAGES, torch.float32)
        self.staging = torch.randint(0, 256, (NUM_SLOTS, SLOT_BYTES), dtype=torch.uint8)
        self.secret = secrets.token_bytes(32)
        self.server = StagingServer(self.pool.data, self.staging, "127.0.0.1", self.secret, LIMITS)
        self.info = StagingInfo("127.0.0.1", self.server.port, 0, SLOT_BYTES, self.secret.hex())

    def untouched(self) -> bool:
        return bool(torch.all(self.pool.data == SENTINEL))

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.server.port), timeout=5)

    def login(self, peer: str = "hostile", secret: bytes | None = None) -> socket.socket:
        """A connection that did the handshake by hand (with `secret`, default the right one)."""
        sock = self.connect()
        challenge, _ = recv_frame(sock, 0)
        nonce = secrets.token_hex(32)
        mac = hello_mac(secret or self.secret, challenge["nonce"], nonce, peer)
        send_frame(sock, {"op": "hello", "peer": peer, "nonce": nonce, "mac": mac})
        return sock

    def good_write(self, item_ids: list[int]) -> None:
        """A well-behaved sender leases and scatters; the pool items hold the slot's bytes."""
        link = StagingLink(self.info, 5.0, f"good-{secrets.token_hex(4)}")
        try:
            assert link.lease()
            ids = torch.tensor(item_ids, dtype=torch.int64)
            seq = link.request_scatter(0, ids)
            answered: list[int] = []
            while not answered:
                answered = link.answers()
                time.sleep(0.001)
            assert answered == [seq]
            expected = self.staging[link.slots[0], : len(ids) * 256].view(len(ids), 256)
            assert torch.equal(pool_items(self.pool.data)[ids], expected)
        finally:
            link.close()
        self.pool.data.fill_(SENTINEL)


@pytest.fixture
def server() -> Iterator[Server]:
    server = Server()
    yield server
    server.server.close()


def ended(sock: socket.socket) -> bytes:
    """What the server sent before closing the connection; fails if it stays open."""
    data = b""
    sock.settimeout(5)
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:
        pass
    sock.close()
    return data


def settle(server: Server) -> None:
    """Waits until the server noticed every closed connection."""
    for _ in range(500):
        if server.server.num_connections() == (0, 0):
            return
        time.sleep(0.01)
    raise AssertionError(f"connections left: {server.server.num_connections()}")


def ask(sock: socket.socket, header: dict, payload: bytes = b"") -> dict:
    send_frame(sock, header, payload)
    return recv_frame(sock, 0)[0]


def ids(*item_ids: int) -> bytes:
    return struct.pack(f"<{len(item_ids)}q", *item_ids)


def test_without_the_secret_nothing_is_leased_or_scattered(server: Server) -> None:
    skip_hello = server.connect()
    recv_frame(skip_hello, 0)  # the challenge
    send_frame(skip_hello, {"op": "lease", "num_slots": 4})
    send_frame(skip_hello, {"op": "scatter", "slot": 0, "seq": 0, "num_items": 2}, ids(0, 1))
    assert ended(skip_hello) == b""  # told nothing
    wrong = server.login(secret=secrets.token_bytes(32))
    send_frame(wrong, {"op": "lease", "num_slots": 4})
    assert ended(wrong) == b""
    replayed = server.connect()  # a MAC for another challenge
    recv_frame(replayed, 0)
    nonce = secrets.token_hex(32)
    mac = hello_mac(server.secret, "0" * 64, nonce, "hostile")
    send_frame(replayed, {"op": "hello", "peer": "hostile", "nonce": nonce, "mac": mac})
    assert ended(replayed) == b""
    secret_in_clear = server.connect()
    recv_frame(secret_in_clear, 0)
    send_frame(
        secret_in_clear, {"op": "hello", "peer": "x", "nonce": nonce, "mac": server.info.secret}
    )
    assert ended(secret_in_clear) == b""
    assert server.untouched()
    settle(server)
    link = StagingLink(server.info, 5.0, "good")  # nothing was leased by the refused ones
    assert link.lease() and len(link.slots) == SLOTS_PER_LINK
    link.close()
    bad_info = dataclasses.replace(server.info, secret=secrets.token_hex(32))
    with pytest.raises((ControlError, OSError)):
        StagingLink(bad_info, 5.0, "good").lease()


BAD_MESSAGES = [  # (header, payload) after a good hello and a lease of slot(s) [0]
    ({"op": "scatter", "slot": "0", "seq": 0, "num_items": 1}, ids(0)),
    ({"op": "scatter", "slot": True, "seq": 0, "num_items": 1}, ids(0)),
    ({"op": "scatter", "slot": 0, "seq": 0.0, "num_items": 1}, ids(0)),
    ({"op": "scatter", "slot": 0, "seq": 0, "num_items": None}, ids(0)),
    ({"op": "scatter", "slot": 0, "seq": 0}, ids(0)),
    ({"op": "scatter", "slot": 0, "seq": 0, "num_items": 1, "page": 3}, ids(0)),
    ({"op": "scatter", "slot": 1, "seq": 0, "num_items": 1}, ids(0)),  # not leased
    ({"op": "scatter", "slot": 10**30, "seq": 0, "num_items": 1}, ids(0)),
    ({"op": "scatter", "slot": 0, "seq": 5, "num_items": 1}, ids(0)),  # out of order
    ({"op": "scatter", "slot": 0, "seq": 0, "num_items": 1}, ids(48)),  # outside the pool
    ({"op": "scatter", "slot": 0, "seq": 0, "num_items": 2}, ids(3, -1)),
    ({"op": "scatter", "slot": 0, "seq": 0, "num_items": 2}, ids(3, 3)),  # repeated
    ({"op": "scatter", "slot": 0, "seq": 0, "num_items": 2}, ids(3)),  # payload too short
    ({"op": "scatter", "slot": 0, "seq": 0, "num_items": 17}, ids(*range(17))),  # > a slot
    ({"op": "scatter", "slot": 0, "seq": 0, "num_items": 0}, b""),
    ({"op": "lease", "num_slots": 1}, b""),  # a second lease while holding slots
    ({"op": "hello", "peer": "x", "nonce": "0" * 64, "mac": "0"}, b""),
    ({"op": "drop_pool"}, b""),
]


@pytest.mark.parametrize("header,payload", BAD_MESSAGES)
def test_a_bad_message_closes_its_connection_only(
    server: Server, header: dict, payload: bytes
) -> None:
    sock = server.login()
    assert recv_frame(sock, 0)[0] == {"op": "welcome"}
    assert ask(sock, {"op": "lease", "num_slots": 1}) == {"op": "leased", "slots": [0]}
    send_frame(sock, header, payload)
    assert b'"refused"' in ended(sock)
    assert server.untouched()
    server.good_write([47, 0, 5])


@pytest.mark.parametrize("lease", [0, 99, -1, "4", 2.0, None])
def test_a_bad_lease_is_refused(server: Server, lease: object) -> None:
    sock = server.login()
    assert recv_frame(sock, 0)[0] == {"op": "welcome"}
    send_frame(sock, {"op": "lease", "num_slots": lease})
    assert b'"refused"' in ended(sock)
    server.good_write([1])


RAW_FRAMES = [
    struct.pack("<II", 1 << 20, 0),  # a 1 MiB header announced
    struct.pack("<II", 10, 1 << 30),  # a 1 GiB payload announced
    struct.pack("<II", 8, 0) + b"not json",
    struct.pack("<II", 2, 0) + b"[]",
    struct.pack("<II", 1000, 0) + b"[" * 1000,
    struct.pack("<II", 30, 0) + b'{"op": "lease", "num_',  # truncated, then silence
    b"\x05\x00",  # half a frame header, then silence
]


@pytest.mark.parametrize("frame", RAW_FRAMES)
@pytest.mark.parametrize("authenticated", [False, True])
def test_oversized_malformed_and_truncated_frames(
    server: Server, frame: bytes, authenticated: bool
) -> None:
    sock = server.login() if authenticated else server.connect()
    recv_frame(sock, 0)  # the welcome, or the challenge
    sock.sendall(frame)
    ended(sock)  # within the message deadline at the latest
    assert server.untouched()
    settle(server)
    server.good_write([2, 3])


def test_silent_and_idle_connections_are_closed(server: Server) -> None:
    silent = server.connect()  # never says hello
    idle = server.login()
    assert recv_frame(idle, 0)[0] == {"op": "welcome"}
    ended(silent)
    ended(idle)  # after idle_s
    settle(server)


def test_connections_and_leases_per_peer_are_bounded(server: Server) -> None:
    unauthenticated = [server.connect() for _ in range(LIMITS.max_pending + 3)]
    for sock in unauthenticated[:3]:  # the oldest were displaced by the newest
        ended(sock)
    server.good_write([4])  # a good sender still gets in (it too displaces the oldest)
    for sock in unauthenticated:
        sock.close()
    settle(server)
    time.sleep(LIMITS.quarantine_s + 0.05)  # the good sender's slots are leasable again
    first, second = (StagingLink(server.info, 5.0, "greedy") for _ in range(2))
    assert first.lease() and len(first.slots) == SLOTS_PER_LINK
    assert not second.lease()  # one peer holds at most SLOTS_PER_LINK slots
    with pytest.raises(ControlError, match="too many"):
        StagingLink(server.info, 5.0, "greedy")  # nor more than max_links_per_peer links
    other = StagingLink(server.info, 5.0, "other")
    assert other.lease() and set(other.slots).isdisjoint(first.slots)
    third = StagingLink(server.info, 5.0, "third")
    with pytest.raises(ControlError, match="too many"):
        StagingLink(server.info, 5.0, "fourth")  # max_links in all
    for link in (first, second, other, third):
        link.close()
    time.sleep(LIMITS.quarantine_s + 0.1)
    server.good_write([5, 6, 7])


def test_slots_a_connection_left_are_quarantined(server: Server) -> None:
    grab = [StagingLink(server.info, 5.0, f"p{i}") for i in range(2)]
    assert all(link.lease() for link in grab)  # all 8 slots
    late = StagingLink(server.info, 5.0, "late")
    assert not late.lease()
    grab[0].close()
    time.sleep(0.2)
    assert late.lease() and set(late.slots) == {0, 1, 2, 3}
    for link in (*grab[1:], late):
        link.close()


@pytest.mark.usefixtures("mooncake_installed")
def test_the_secret_travels_in_the_endpoint_only() -> None:
    config = json.dumps({"staging_slot_bytes": 4096, "timeout_s": 2.0})
    receiver = MooncakeReceiver(make_pool(16, torch.float32), config)
    src = make_pool(16, torch.float32, seed=3)
    sender = MooncakeSender(src, config)
    try:
        endpoint = receiver.endpoint()
        secret = endpoint["staging"]["secret"]
        assert len(bytes.fromhex(secret)) == 32
        assert secret not in repr(StagingInfo.from_json(endpoint["staging"]))
        forged = json.loads(json.dumps(endpoint))
        forged["id"] += "-forged"
        forged["staging"]["secret"] = secrets.token_hex(32)
        with pytest.raises(TransferError, match="staging server") as error:
            sender.write(forged, [1, 5, 9], [2, 0, 7])
        assert forged["staging"]["secret"] not in str(error.value)
        assert torch.all(receiver.pool.data == SENTINEL)
        forged["staging"]["secret"] = "x"
        with pytest.raises(TransferError, match="malformed") as error:
            sender.write(forged, [1], [2])
        assert secret not in str(error.value)
        # The server closes an idle link; the sender notices and opens a new one.
        staging_server = receiver._staging
        assert staging_server is not None
        staging_server.limits = dataclasses.replace(staging_server.limits, idle_s=0.2)
        for _ in range(2):
            sender.write(endpoint, [1, 5, 9], [2, 0, 7])
            time.sleep(0.5)
        assert sender.num_writes["coalesced"] == 2
        assert torch.equal(receiver.pool.data[:, :, [2, 0, 7]], src.data[:, :, [1, 5, 9]])
    finally:
        sender.close()
        receiver.close()


@pytest.fixture
def mooncake_installed() -> None:
    from mooncake_fixtures import require_mooncake

    require_mooncake()
