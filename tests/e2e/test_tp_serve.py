"""A tensor-parallel rank behind the HTTP server (issue 32): `kvstrata serve
--tensor-parallel-size 2` (vLLM's spelling of --tp-size) answers with TP 1's greedy tokens;
when a follower worker dies, the idle rank ends at once: /health stops answering 200, no
request is served, and the log names the worker (a supervisor restarts the whole rank:
no half-rank)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
from pd_harness import MAX_NEW, PAGE, generate, unified
from server_harness import start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from suite_guards import process_tree


def test_tp2_rank_serves_and_fails_whole_when_a_worker_dies(
    tiny_llama: Path, tmp_path: Path
) -> None:
    prompts = [[5, 9, 13, 2, 7], [(11 * i) % 500 + 1 for i in range(40)]]
    want = unified(tiny_llama, prompts)
    server = start_server(
        tiny_llama,
        tmp_path,
        "--tensor-parallel-size",
        "2",
        "--page-size",
        str(PAGE),
        "--num-kv-pages",
        "256",
        "--disable-radix-cache",
        "--dtype",
        "float32",
    )
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            got = [generate(http, prompt).json()["output_ids"] for prompt in prompts]
            assert got == want and all(len(ids) == MAX_NEW for ids in got)
            followers = [
                p
                for p in process_tree(server.proc.pid)
                if "spawn_main" in p.command and "resource_tracker" not in p.command
            ]
            assert len(followers) == 1, [p.command for p in followers]
            os.kill(followers[0].pid, signal.SIGKILL)
            # The rank ends on its own, idle as it is (its watch sees the worker go).
            deadline = time.monotonic() + 30
            while server.proc.poll() is None:
                try:
                    if http.get("/health", timeout=5).status_code != 200:
                        break
                except httpx.HTTPError:
                    break
                assert time.monotonic() < deadline, "/health still answers 200"
                time.sleep(0.1)
            try:
                status: int | None = generate(http, prompts[0]).status_code
            except httpx.HTTPError:
                status = None  # the rank has ended
            assert status is None or status >= 500
    finally:
        server.stop()
    assert "kvstrata-tp1" in server.log()


def test_followers_leave_with_a_killed_leader(tiny_llama: Path, tmp_path: Path) -> None:
    server = start_server(
        tiny_llama, tmp_path, "--tp-size", "2", "--page-size", str(PAGE), "--num-kv-pages", "64"
    )
    followers = [p.pid for p in process_tree(server.proc.pid) if "spawn_main" in p.command]
    server.proc.kill()
    server.proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in followers):
        time.sleep(0.2)
    alive = [pid for pid in followers if Path(f"/proc/{pid}").exists()]
    assert followers and not alive, alive
