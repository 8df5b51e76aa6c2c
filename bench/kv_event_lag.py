"""How late a router learns of a prefix a rank just cached (issue 18.1): one rank, and two
routers over it, one following the rank's `GET /kv_events` stream, one polling its
`/get_load` (--no-kv-events, every --poll-interval-s). Each trial sends a new 64-token
prompt straight to the rank, at a random phase of the poll cycle, and times from its
answer (the rank cached the prompt before answering) until each router's digest copy
holds the prompt's two chunk boundaries, read from the router's /get_load every ~1 ms.

    python bench/kv_event_lag.py [--model DIR] [--trials 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvstrata.model.tiny import make_tiny_model

PAGE, CHUNK = 16, 32
PROMPT_TOKENS = 64  # two chunk boundaries
STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(log_path: Path, *argv: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstrata", *argv, "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def wait_until(http: httpx.Client, url: str, ready: Any) -> None:
    deadline_s = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline_s:
        try:
            if ready(http.get(url, timeout=5)):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} was not ready in time")


def num_entries(http: httpx.Client, router_url: str) -> int:
    (rank,) = http.get(f"{router_url}/get_load", timeout=5).json()
    return rank["digest"]["num_entries"] if rank["digest"] else 0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="model dir (default: a tiny random one)")
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--poll-interval-s", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="", help="write the results here too")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kv-event-lag-"))
    model = args.model or str(make_tiny_model(work / "tiny", arch="llama", seed=0))
    os.environ.setdefault("KVSTRATA_CLUSTER_KEY", secrets.token_urlsafe(24))
    rng = random.Random(args.seed)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        rank, rank_url = spawn(work / "rank.log", "serve", "--model", model,
                               "--page-size", str(PAGE), "--num-kv-pages", "8192",
                               "--max-model-len", "1024", "--log-level", "warning")  # fmt: skip
        procs.append(rank)
        routers = {}
        for name, extra in (("events", ()), ("polling", ("--no-kv-events",))):
            proc, url = spawn(work / f"router-{name}.log", "router", "--decode", rank_url,
                              "--model", model, "--load-balance-method", "cache_aware",
                              "--dp-routing-digest-chunk-size", str(CHUNK),
                              "--load-poll-interval-s", str(args.poll_interval_s),
                              "--log-level", "warning", *extra)  # fmt: skip
            procs.append(proc)
            routers[name] = url
        with httpx.Client() as http:
            wait_until(http, f"{rank_url}/health", lambda r: r.status_code == 200)
            for url in routers.values():
                wait_until(http, f"{url}/get_load",
                           lambda r: r.status_code == 200 and r.json()[0]["digest"])  # fmt: skip
            lags_s: dict[str, list[float]] = {name: [] for name in routers}
            for _ in range(args.trials):
                time.sleep(rng.uniform(0, args.poll_interval_s))  # a random poll phase
                targets = {name: num_entries(http, url) + 2 for name, url in routers.items()}
                prompt = [rng.randrange(1, 500) for _ in range(PROMPT_TOKENS)]
                body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}
                answer = http.post(f"{rank_url}/generate", json=body, timeout=60)
                answered_s = time.perf_counter()
                answer.raise_for_status()
                pending = dict(routers)
                while pending:
                    for name, url in list(pending.items()):
                        if num_entries(http, url) >= targets[name]:
                            lags_s[name].append(time.perf_counter() - answered_s)
                            del pending[name]
                    time.sleep(0.001)
            live = http.get(f"{routers['events']}/get_load", timeout=5).json()[0]["events_live"]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
    results = {
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.processor() or 'cpu'})",
        "trials": args.trials, "poll_interval_s": args.poll_interval_s,
        "events_stream_live_at_end": live,
        "lag_ms": {
            name: {"p50": 1e3 * percentile(v, 0.5), "p99": 1e3 * percentile(v, 0.99),
                   "mean": 1e3 * statistics.fmean(v), "max": 1e3 * max(v)}
            for name, v in lags_s.items()
        },
    }  # fmt: skip
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
