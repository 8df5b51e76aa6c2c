"""Connection hygiene and key order at a real rank and a real router, each started with a
1024 open-file limit (issue 27, findings 3, 5 and 7): 2,000 idle connections leave both
serving and are closed by them; a head or body sent too slowly is cut off; busy
connections past --max-connections get 503 with Retry-After while /health still answers;
one client address holds at most a few /kv_events streams, freed when it goes; and every
keyed endpoint answers 401 to a missing key before it reads a body."""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cluster_key import ROUTER_KEY, TEST_CLUSTER_KEY
from server_harness import SERVER_FLAGS, ServerProcess, _free_port
from test_kv_events import wait_for

from kvstrata.cluster.child import die_with_parent

OPEN_FILES = 1024  # the children's RLIMIT_NOFILE, soft and hard: the flood is 2,000
NUM_IDLE = 2000
TIMEOUT_FLAGS = ("--keep-alive-timeout-s", "2", "--header-timeout-s", "2",
                 "--body-timeout-s", "2", "--min-body-bytes-per-s", "100")  # fmt: skip
PROMPT = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 2}}
FD_EXHAUSTION = ("Too many open files", "out of system resource")


def start(log_dir: Path, *argv: str, limit: int = OPEN_FILES) -> ServerProcess:
    """`python -m kvstrata ARGV` with an open-file limit of `limit`, waited for; it dies
    with pytest (the suite's guard would add that, but only to a Popen without a
    preexec_fn of its own)."""
    port = _free_port()
    log_path = log_dir / f"{argv[0]}-{port}.log"
    parent_pid = os.getpid()

    def in_the_child() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
        die_with_parent(signal.SIGKILL, parent_pid)

    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstrata", *argv, "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=in_the_child,
        )  # fmt: skip
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    wait_for(f"{server.base_url}/health", lambda body: body.get("status") == "ok", 180)
    return server


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list]:
    """[rank, router], both with small timeouts and OPEN_FILES."""
    logs = tmp_path_factory.mktemp("edge")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < NUM_IDLE + 200:
        pytest.skip(f"the open-file limit {hard} cannot hold {NUM_IDLE} client sockets")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, NUM_IDLE + 200), hard))
    rank = start(logs, "serve", "--model", str(tiny_llama), *SERVER_FLAGS, *TIMEOUT_FLAGS)
    router = start(logs, "router", "--decode", rank.base_url, *TIMEOUT_FLAGS)
    try:
        yield [rank, router]
    finally:
        for proc in (router, rank):
            assert proc.stop() == 0, proc.log()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def num_open_files(server: ServerProcess) -> int:
    return len(os.listdir(f"/proc/{server.proc.pid}/fd"))


def connect(server: ServerProcess, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(30)
    sock.connect(("127.0.0.1", int(server.base_url.rsplit(":", 1)[1])))
    return sock


def read_until_closed(sock: socket.socket, timeout_s: float = 30.0) -> bytes:
    """What the server sends until it closes the connection (bounded: fails if it never
    does within `timeout_s`)."""
    sock.settimeout(timeout_s)
    answer = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def flood(server: ServerProcess, num: int) -> list[socket.socket]:
    """`num` connections that send nothing, opened at once from eight addresses."""
    port = int(server.base_url.rsplit(":", 1)[1])
    socks = []
    for i in range(num):
        sock = socket.socket()
        sock.bind((f"127.0.0.{2 + i % 8}", 0))
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        socks.append(sock)
    poller = select.poll()
    for sock in socks:
        poller.register(sock, select.POLLOUT)
    pending, deadline_s = {s.fileno() for s in socks}, time.monotonic() + 60
    while pending and time.monotonic() < deadline_s:
        for fd, _ in poller.poll(100):
            pending.discard(fd)
            poller.unregister(fd)
    assert not pending, f"{len(pending)} connections never completed"
    return socks


def test_idle_connections_are_closed_and_requests_still_served(cluster: list) -> None:
    rank, router = cluster
    for server, request in ((rank, "/generate"), (router, "/generate")):
        idle_files = num_open_files(server)
        socks = flood(server, NUM_IDLE)
        try:
            with httpx.Client(base_url=server.base_url, timeout=30) as http:
                assert http.get("/health").status_code == 200
                answer = http.post(request, json=PROMPT)
                assert answer.status_code == 200, answer.text
            assert num_open_files(server) < OPEN_FILES
            # Nothing was sent on them: the server closes them itself, the sockets open here.
            deadline_s = time.monotonic() + 60
            while num_open_files(server) > idle_files + 8:
                assert time.monotonic() < deadline_s, f"{num_open_files(server)} files open"
                time.sleep(0.2)
        finally:
            for sock in socks:
                sock.close()
        assert not any(text in server.log() for text in FD_EXHAUSTION), server.log()[-2000:]
    (seen,) = httpx.get(f"{router.base_url}/get_load", timeout=5).json()
    assert seen["healthy"], seen  # the router never lost its rank


def test_slow_heads_and_bodies_are_cut_off(cluster: list) -> None:
    idle, partial, trickle = [], [], []
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    for server in cluster:
        idle.append(connect(server))  # never sends
        partial.append(connect(server))
        partial[-1].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        trickle.append(connect(server))
        trickle[-1].sendall(head + b"Content-Length: 100000\r\n\r\n{")
    deadline_s = time.monotonic() + 60  # 100 kB at 2 bytes a second: hours if let be
    while trickle and time.monotonic() < deadline_s:
        for sock in list(trickle):
            try:
                sock.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                trickle.remove(sock)
                sock.close()
        time.sleep(0.5)
    assert not trickle, "a trickling body was never cut off"
    for sock in idle:
        assert read_until_closed(sock) == b""
        sock.close()
    for sock in partial:
        assert read_until_closed(sock).startswith(b"HTTP/1.1 408 ")
        sock.close()


def test_busy_connections_past_the_bound_get_503_with_retry_after(
    cluster: list, tmp_path: Path
) -> None:
    rank = cluster[0]
    router = start(tmp_path, "router", "--decode", rank.base_url, "--max-connections", "6",
                   "--max-connections-per-address", "3", "--body-timeout-s", "120")  # fmt: skip
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    busy = []
    try:
        for source in ("127.0.0.2", "127.0.0.3"):  # bodies that have not come yet
            for _ in range(3):
                busy.append(connect(router, source))
                busy[-1].sendall(head + b"Content-Length: 1000\r\n\r\n{")
        wait_for(f"{router.base_url}/health", lambda body: body.get("status") == "ok")
        # Its address holds 3 busy connections: a fourth gets a 503 at once.
        refused = read_until_closed(connect(router, "127.0.0.2"))
        assert refused.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in refused.lower()
        # Six busy in all: another address gets a 503 with Retry-After; /health answers.
        answer = httpx.get(f"{router.base_url}/v1/models", timeout=10)
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "too_many_connections"
        assert httpx.get(f"{router.base_url}/health", timeout=10).status_code == 200
    finally:
        for sock in busy:
            sock.close()
    wait_for(f"{router.base_url}/v1/models", lambda body: body.get("object") == "list")
    assert router.stop() == 0, router.log()


def kv_events_stream(server: ServerProcess, source: str) -> tuple[socket.socket, int]:
    """A /kv_events subscription from `source`, and the status it got."""
    sock = connect(server, source)
    head = "GET /kv_events?heartbeat_s=0.5 HTTP/1.1\r\nHost: x\r\nX-Kvstrata-Cluster-Key: "
    sock.sendall(f"{head}{TEST_CLUSTER_KEY}\r\n\r\n".encode())
    status = sock.recv(12)  # b"HTTP/1.1 200"
    return sock, int(status.split(b" ")[1])


def test_one_address_holds_a_few_kv_events_streams_freed_when_it_goes(
    cluster: list, tmp_path: Path
) -> None:
    rank = cluster[0]
    streams = [kv_events_stream(rank, "127.0.0.2") for _ in range(70)]
    held = [sock for sock, status in streams if status == 200]
    assert len(held) == 8 and {status for _, status in streams} == {200, 503}
    for sock, status in streams:
        if status != 200:
            sock.close()
    router = start(tmp_path, "router", "--decode", rank.base_url)
    try:  # a real router still gets its subscription
        wait_for(f"{router.base_url}/get_load", lambda ranks: ranks[0]["events_live"], 30)
    finally:
        assert router.stop() == 0, router.log()
    for sock in held:  # the subscriber goes: its slots are free again
        sock.close()
    deadline_s = time.monotonic() + 30
    while True:
        again = [kv_events_stream(rank, "127.0.0.2") for _ in range(8)]
        statuses = [status for _, status in again]
        for sock, _ in again:
            sock.close()
        if statuses == [200] * 8:
            break
        assert time.monotonic() < deadline_s, statuses
        time.sleep(0.2)


def test_keyed_endpoints_refuse_a_missing_key_before_reading_the_body(cluster: list) -> None:
    rank, router = cluster
    malformed = b'{"page_hashes": [unclosed'
    json_body = {"content-type": "application/json"}  # else FastAPI never parses it
    for headers in (json_body, json_body | {"X-Kvstrata-Cluster-Key": "wrong"}):
        calls = [
            ("POST", f"{rank.base_url}/hicache/storage/exists", headers),
            ("POST", f"{rank.base_url}/pd/prefill", headers),
            ("GET", f"{rank.base_url}/kv_events?digest_chunk_size=abc", headers),
            ("POST", f"{rank.base_url}/generate",
             headers | {"X-Kvstrata-Prefill-Url": "http://127.0.0.1:9"}),
            ("POST", f"{router.base_url}/workers", headers),
            ("DELETE", f"{router.base_url}/workers/x", headers),
        ]  # fmt: skip
        answers = {
            f"{method} {url}": httpx.request(method, url, content=malformed, headers=sent)
            for method, url, sent in calls
        }
        statuses = {call: answer.status_code for call, answer in answers.items()}
        assert set(statuses.values()) == {401}, statuses
        assert {a.json()["error"]["code"] for a in answers.values()} == {"invalid_cluster_key"}
    # With the key the body is read, and found malformed.
    for url in (f"{rank.base_url}/hicache/storage/exists", f"{router.base_url}/workers"):
        answer = httpx.post(url, content=malformed, headers=json_body | ROUTER_KEY, timeout=10)
        assert answer.status_code == 400, answer.text
