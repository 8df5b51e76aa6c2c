"""Ranks trust only ranks (issue 15, items 1-3), tried as a hostile local user would against
real processes: /pd/* without the cluster key, hostile ipc endpoints (file paths, links,
foreign pools), 50 malformed tasks, and prefill URLs from clients or that are no URL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from cluster_key import ROUTER_KEY
from pd_harness import COMMON, PAGE, assert_rank_idle, generate, start_decode, start_prefill
from pd_harness import unified as unified_outputs
from server_harness import ServerProcess, start_server

from kvstrata.config.server import CLUSTER_KEY_ENV
from kvstrata.disagg.transport.ipc import shared_pool_data
from kvstrata.disagg.transport.ipc_pool import HEADER_BYTES, SHM_DIR, read_own_header
from kvstrata.http.middleware import CLUSTER_KEY_HEADER
from kvstrata.http.prefill_url import PREFILL_URL_HEADER

KEY = ROUTER_KEY  # the cluster key every process of these tests inherits
NUM_POOL_PAGES = 16
# The tiny llama's pool: [layers, K/V, pages, page_size, kv heads, head_dim], float32.
POOL_SHAPE = (2, 2, NUM_POOL_PAGES, PAGE, 2, 16)
VOCAB = 515
PROMPT = list(range(3, 13))  # 10 tokens: 3 pages of 4


@pytest.fixture(scope="module")
def ranks(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    logs = tmp_path_factory.mktemp("trust-logs")
    prefill = start_prefill(tiny_llama, logs)
    decode = start_decode(tiny_llama, logs, [prefill.base_url])
    yield {"prefill": prefill, "decode": decode}
    for server in (decode, prefill):
        assert server.stop() == 0, server.log()
        assert "Traceback" not in server.log(), server.log()


@pytest.fixture()
def pool() -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
    """A genuine decode pool (made the way a decode rank makes one) and its endpoint."""
    data, path = shared_pool_data(POOL_SHAPE, torch.float32)
    header = read_own_header(path)
    endpoint = {
        "backend": "ipc", "id": str(path), "shape": list(POOL_SHAPE), "dtype": "torch.float32",
        "shm_path": str(path), "owner": header.owner, "generation": header.generation,
    }  # fmt: skip
    yield data, endpoint
    del data


def task(endpoint: dict[str, Any], **fields: Any) -> dict[str, Any]:
    body = {
        "room": f"room-{uuid.uuid4().hex[:8]}", "token_ids": PROMPT, "prefix_len": 0,
        "dst_page_ids": [5, 1, 9], "decode_endpoint": endpoint,
        "sampling": {"temperature": 0.0, "max_tokens": 1},
    }  # fmt: skip
    return body | fields


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"} | (headers or {})
    return httpx.post(url, content=content, headers=headers, timeout=60)


def assert_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def assert_serves_a_good_room(prefill: ServerProcess, pool: tuple[torch.Tensor, dict]) -> None:
    data, endpoint = pool
    answer = post(prefill.base_url + "/pd/prefill", task(endpoint), KEY)
    assert answer.status_code == 200, answer.text
    assert answer.json()["num_pages_written"] == 3
    written = [p for p in range(NUM_POOL_PAGES) if data[:, :, p].abs().sum() > 0]
    assert written == [1, 5, 9]
    with httpx.Client(base_url=prefill.base_url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        assert_rank_idle(http)


def test_pd_endpoints_need_the_cluster_key(ranks: dict, pool: tuple) -> None:
    prefill = ranks["prefill"].base_url
    data, endpoint = pool
    for headers in ({}, {CLUSTER_KEY_HEADER: "wrong"}, {"authorization": "Bearer x"}):
        error = assert_error(post(prefill + "/pd/prefill", task(endpoint), headers), 401)
        assert error["code"] == "invalid_cluster_key"
        assert_error(post(prefill + "/pd/abort", {"room": "r1"}, headers), 401)
    assert data.abs().sum() == 0  # nothing was computed into the pool
    with httpx.Client(base_url=prefill, timeout=30) as http:
        assert_rank_idle(http)
    assert_serves_a_good_room(ranks["prefill"], pool)


def test_hostile_endpoints_are_refused_and_nothing_is_written(
    ranks: dict, pool: tuple, tmp_path: Path
) -> None:
    prefill = ranks["prefill"].base_url
    data, endpoint = pool
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 1024)
    link = SHM_DIR / f"kvstrata-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    link.symlink_to(victim)
    absent = SHM_DIR / f"kvstrata-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    forged = SHM_DIR / f"kvstrata-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    pool_bytes = HEADER_BYTES + data.numel() * 4
    forged.write_bytes(b"\x07" * pool_bytes)  # the right name and size, no pool header
    other_pool, _ = shared_pool_data(POOL_SHAPE, torch.float32)
    try:
        hostile = {
            "passwd": endpoint | {"shm_path": "/etc/passwd"},
            "dotdot": endpoint | {"shm_path": f"/dev/shm/../..{victim}"},
            "tmp file": endpoint | {"shm_path": str(victim)},
            "absent": endpoint | {"shm_path": str(absent)},
            "symlink": endpoint | {"shm_path": str(link)},
            "no header": endpoint | {"shm_path": str(forged)},
            "other owner": endpoint | {"owner": "0" * 32},
            "other generation": endpoint | {"generation": endpoint["generation"] + 1},
            "bigger pool": endpoint | {"shape": [2, 2, 4096, PAGE, 2, 16]},
        }
        for name, bad in hostile.items():
            error = assert_error(post(prefill + "/pd/prefill", task(bad), KEY), 400)
            assert error["param"] == "decode_endpoint", (name, error)
            assert "shape" not in error["message"] and "4096" not in error["message"], name
        assert victim.read_bytes() == b"precious" * 1024
        assert not absent.exists() and forged.read_bytes() == b"\x07" * pool_bytes
        assert data.abs().sum() == 0 and other_pool.abs().sum() == 0
        # a layout that is not this rank's is refused without quoting either shape
        error = assert_error(
            post(prefill + "/pd/prefill", task(endpoint | {"shape": [2, 2, 16, 4, 4, 16]}), KEY),
            400,
        )
        assert "[" not in error["message"], error
    finally:
        for path in (link, forged):
            path.unlink(missing_ok=True)
    assert_serves_a_good_room(ranks["prefill"], pool)


def malformed_tasks(endpoint: dict[str, Any]) -> list[tuple[str, bytes | Any, str | None]]:
    """(what, body, the field the error must name, None: the body as a whole)."""
    good = task(endpoint)
    cases: list[tuple[str, bytes | Any, str | None]] = [
        ("not json", b"{not json", None), ("a list", [good], None), ("a number", 7, None),
        ("empty object", {}, "room"), ("unknown field", good | {"extra": 1}, "extra"),
    ]  # fmt: skip
    for name in ("room", "token_ids", "prefix_len", "dst_page_ids", "decode_endpoint"):
        cases.append((f"no {name}", {k: v for k, v in good.items() if k != name}, name))
    bad_fields: list[tuple[str, Any]] = [
        ("room", ""), ("room", "a/b"), ("room", "r" * 500), ("room", 5),
        ("token_ids", []), ("token_ids", ["3", "4"]), ("token_ids", [3.0, 4.0]),
        ("token_ids", [True, 4]), ("token_ids", [-1, 4]), ("token_ids", [VOCAB, 4]),
        ("token_ids", [2**40]), ("token_ids", "3 4"),
        ("prefix_len", -4), ("prefix_len", 1.5), ("prefix_len", "0"), ("prefix_len", 2),
        ("prefix_len", 12), ("prefix_len", None),
        ("dst_page_ids", [5, 1]), ("dst_page_ids", [5, 5, 9]), ("dst_page_ids", [5, 1, 16]),
        ("dst_page_ids", [-1, 1, 9]), ("dst_page_ids", [5.0, 1, 9]), ("dst_page_ids", 5),
        ("sampling", {"temperature": "hot"}), ("sampling", {"top_p": 0}),
        ("sampling", {"top_p": 2.0}), ("sampling", {"max_tokens": 0}),
        ("sampling", {"seed": 1.5}), ("sampling", {"stop": 5}), ("sampling", {"nucleus": 1}),
        ("sampling", {"top_k": -1}), ("sampling", {"stop_token_ids": [VOCAB]}),
        ("sampling", {"ignore_eos": "yes"}), ("sampling", []),
    ]  # fmt: skip
    for name, value in bad_fields:
        cases.append((f"{name}={value!r:.30}", good | {name: value}, name))
    endpoint_fields: list[tuple[str, Any]] = [
        ("backend", "tcp"), ("shape", [2, 2, 16]), ("shape", [2, 2, 0, 4, 2, 16]),
        ("dtype", "torch.int8"), ("owner", "xyz"), ("generation", -1), ("shm_path", 7),
        ("unknown", 1),
    ]  # fmt: skip
    for name, value in endpoint_fields:
        cases.append((f"endpoint {name}", good | {"decode_endpoint": endpoint | {name: value}},
                      "decode_endpoint"))  # fmt: skip
    mooncake = {"backend": "mooncake", "id": "m", "session": "127.0.0.1:1", "base_ptr": 0,
                "shape": list(POOL_SHAPE), "dtype": "torch.float32"}  # fmt: skip
    cases.append(("mooncake to an ipc rank", good | {"decode_endpoint": mooncake},
                  "decode_endpoint"))  # fmt: skip
    # A well-formed CUDA IPC endpoint sent to this CPU rank: refused at the door (it once
    # reached the engine thread, which died of "Torch not compiled with CUDA enabled").
    cuda = {k: v for k, v in endpoint.items() if k not in ("shm_path", "owner", "generation")}
    cuda |= {"pid": os.getpid(), "cuda_ipc": {
        "size": [64], "stride": [1], "offset": 0, "device": 0, "handle": "AAAA",
        "storage_bytes": 256, "storage_offset_bytes": 0, "ref_counter_handle": "AAAA",
        "ref_counter_offset": 0, "event_handle": "AAAA", "event_sync_required": False,
    }}  # fmt: skip
    cases.append(("cuda ipc to a cpu rank", good | {"decode_endpoint": cuda}, "decode_endpoint"))
    return cases


def test_malformed_tasks_fail_alone_and_the_rank_keeps_serving(ranks: dict, pool: tuple) -> None:
    prefill = ranks["prefill"]
    data, endpoint = pool
    cases = malformed_tasks(endpoint)
    assert len(cases) >= 50
    for what, body, field in cases:
        error = assert_error(post(prefill.base_url + "/pd/prefill", body, KEY), 400)
        if field is not None:
            assert error["param"] == field, (what, error)
        if what == "cuda ipc to a cpu rank":
            assert "not on a GPU" in error["message"], error
    assert_error(post(prefill.base_url + "/pd/abort", {"room": ["x"]}, KEY), 400)
    assert_error(post(prefill.base_url + "/pd/abort", b"[]", KEY), 400)
    assert data.abs().sum() == 0
    assert_serves_a_good_room(prefill, pool)


class FakePrefill:
    """A server a hostile client runs: it answers /pd/prefill without writing anything."""

    def __init__(self) -> None:
        self.num_calls = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                outer.num_calls += 1
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                answer = {"room": body.get("room", ""), "first_token_id": 7,
                          "num_pages_written": len(body.get("dst_page_ids", [])),
                          "prefill_cached_tokens": 0}  # fmt: skip
                raw = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_prefill_url_header_only_with_the_key_and_only_a_url(ranks: dict, tiny_llama: Path) -> None:
    fake = FakePrefill()
    try:
        with httpx.Client(base_url=ranks["decode"].base_url, timeout=30) as http:
            for headers in ({}, {CLUSTER_KEY_HEADER: "wrong"}):
                answer = generate(http, PROMPT, **{PREFILL_URL_HEADER: fake.url}, **headers)
                error = assert_error(answer, 401)
                assert error["param"] == PREFILL_URL_HEADER
            assert fake.num_calls == 0
            for bad in ("not a url", "ftp://x", "http://[::1", "http://h:99999", "http://h/pd"):
                answer = generate(http, PROMPT, **{PREFILL_URL_HEADER: bad}, **KEY)
                assert assert_error(answer, 400)["code"] == "invalid_prefill_url", bad
            assert_rank_idle(http)  # no room, no page, no request behind
            good = generate(http, PROMPT, **{PREFILL_URL_HEADER: ranks["prefill"].base_url}, **KEY)
            assert good.status_code == 200, good.text
            assert good.json()["output_ids"] == unified_outputs(tiny_llama, [PROMPT])[0]
            assert_rank_idle(http)
    finally:
        fake.server.shutdown()


def test_a_rank_without_a_cluster_key(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A standalone unified rank serves its users and refuses every rank-to-rank call; a
    prefill or decode rank does not start without the key."""
    monkeypatch.delenv(CLUSTER_KEY_ENV)
    server = start_server(tiny_llama, tmp_path, "--page-size", str(PAGE), "--log-level", "warning")
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            assert http.get("/server_info").json()["server_config"]["cluster_key_set"] is False
            assert generate(http, PROMPT).status_code == 200
            for path in ("/pd/prefill", "/pd/abort"):
                error = assert_error(post(server.base_url + path, {"room": "r"}, KEY), 401)
                assert "no cluster key" in error["message"]
    finally:
        assert server.stop() == 0
    for mode in ("prefill", "decode"):
        done = subprocess.run(
            [sys.executable, "-m", "kvstrata", "serve", "--model", str(tiny_llama),
             "--disaggregation-mode", mode, "--port", "1", *COMMON],
            capture_output=True, text=True, timeout=120, env=dict(os.environ),
        )  # fmt: skip
        assert done.returncode == 2 and "--cluster-key-file" in done.stderr, done.stderr
