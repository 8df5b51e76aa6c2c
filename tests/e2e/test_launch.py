"""`kvstrata launch` as a user runs it: 1 prefill + 2 decode ranks and a router as child
processes, URLs printed, flags given to the roles that take them, SIGTERM stopping every
child; refused flags and a child that cannot start stop everything with a clear message."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvstrata.__main__ import main
from kvstrata.cluster.rank_flags import split_rank_flags
from kvstrata.config import ConfigError
from kvstrata.config.server import CLUSTER_KEY_ENV
from kvstrata.core import SamplingParams
from kvstrata.http.middleware import CLUSTER_KEY_HEADER
from kvstrata.llm import LLM

RANK_FLAGS = (
    "--page-size", "16", "--num-kv-pages", "256", "--max-model-len", "1024",
    "--disaggregation-decode-enable-radix-cache", "--log-level", "warning",
)  # fmt: skip
CHILD_LINE = re.compile(r"^(prefill rank \d|decode rank \d|router): (http://\S+) \(pid (\d+)")
STARTUP_TIMEOUT_S = 240.0


@dataclass
class Launched:
    proc: subprocess.Popen[str]
    urls: dict[str, str]  # child name -> URL
    pids: dict[str, int]
    output: list[str]


def launch(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvstrata", "launch", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def read_until_ready(proc: subprocess.Popen[str]) -> list[str]:
    """The launcher's output up to its `ready:` line (bounded wait; fails if it exits)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    output: list[str] = []
    deadline_s = time.monotonic() + STARTUP_TIMEOUT_S
    while not output or not output[-1].startswith("ready: "):
        line = lines.get(timeout=max(0.0, deadline_s - time.monotonic()))
        assert line is not None, "the launcher exited:\n" + "\n".join(output)
        output.append(line)
    return output


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def launched(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    log_dir = tmp_path_factory.mktemp("launch-logs")
    proc = launch("--model", str(tiny_llama), "--num-prefill", "1", "--num-decode", "2",
                  "--port", "0", "--log-dir", str(log_dir), "--load-poll-interval-s", "0.2",
                  "--rank-devices", "cpu", "cpu", "cpu", *RANK_FLAGS)  # fmt: skip
    try:
        output = read_until_ready(proc)
        matches = [m for line in output if (m := CHILD_LINE.match(line))]
        yield Launched(proc, {m[1]: m[2] for m in matches},
                       {m[1]: int(m[3]) for m in matches}, output)  # fmt: skip
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)


def test_launch_prints_urls_and_every_rank_gets_its_role(launched: Launched) -> None:
    assert sorted(launched.urls) == ["decode rank 0", "decode rank 1", "prefill rank 0", "router"]
    assert launched.output[-1].startswith(f"ready: {launched.urls['router']} ")
    router = launched.urls["router"]
    health = httpx.get(router + "/health", timeout=10).json()
    assert health == {"status": "ok", "num_healthy_prefill": 1, "num_prefill": 1,
                      "num_healthy_decode": 2, "num_decode": 2}  # fmt: skip
    loads = httpx.get(router + "/get_load", timeout=10).json()
    assert [(r["role"], r["url"]) for r in loads] == [
        ("prefill", launched.urls["prefill rank 0"]),
        ("decode", launched.urls["decode rank 0"]),
        ("decode", launched.urls["decode rank 1"]),
    ]
    for name in ("prefill rank 0", "decode rank 0", "decode rank 1"):
        info = httpx.get(launched.urls[name] + "/server_info", timeout=10).json()
        engine = info["engine_config"]
        role, index = name.split(" rank ")
        assert (engine["disaggregation_mode"], info["rank"]) == (role, int(index))
        # the decode-only flag went to the decode ranks only; the rest to every rank
        assert engine["disaggregation_decode_enable_radix_cache"] is (role == "decode")
        assert (engine["page_size"], engine["num_kv_pages"]) == (16, 256)
        assert engine["device"] == "cpu"  # from --rank-devices (the default is auto)


def test_pd_generate_through_the_router_equals_unified_greedy(
    launched: Launched, tiny_llama: Path
) -> None:
    llm = LLM(str(tiny_llama), page_size=16, num_kv_pages=256, max_model_len=1024)
    params = SamplingParams(max_tokens=8, temperature=0)
    prompt = list(range(3, 40))  # > 2 pages: the second turn can reuse the first's pages
    with httpx.Client(base_url=launched.urls["router"], timeout=120) as http:
        for turn in range(3):
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
            response = http.post("/generate", json=body)
            assert response.status_code == 200, response.text
            (expected,) = llm.generate(input_ids=[prompt], sampling_params=params)
            assert response.json()["output_ids"] == expected.output_ids, f"turn {turn}"
            prompt = [*prompt, *expected.output_ids, 7, 8, 9]
    # The prefill rank counts what its transfers wrote, in whole pages of its pool.
    text = httpx.get(launched.urls["prefill rank 0"] + "/metrics", timeout=10).text
    metrics = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
               if line.startswith("kvstrata_pd_")}  # fmt: skip
    page_bytes = llm.engine.pool.page_bytes
    assert metrics["kvstrata_pd_sent_pages"] >= 3  # three turns, at least a page each
    assert metrics["kvstrata_pd_sent_bytes"] == metrics["kvstrata_pd_sent_pages"] * page_bytes
    assert metrics["kvstrata_pd_send_seconds"] > 0


def test_every_child_gets_the_cluster_key_as_a_file(launched: Launched) -> None:
    """Without --api-key too: the launcher generates a cluster key and hands it to every
    rank and the router as one 0600 file; /pd/* refuses callers without it."""
    paths = set()
    for pid in launched.pids.values():
        argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        paths.add(argv[argv.index(b"--cluster-key-file") + 1].decode())
    (path,) = paths
    key = Path(path).read_text().strip()
    assert len(key) >= 32 and stat.S_IMODE(Path(path).stat().st_mode) == 0o600
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            assert key.encode() not in (entry / "cmdline").read_bytes(), entry
    prefill = launched.urls["prefill rank 0"] + "/pd/prefill"
    assert httpx.post(prefill, json={}, timeout=10).status_code == 401
    inherited = {CLUSTER_KEY_HEADER: os.environ.get(CLUSTER_KEY_ENV, "")}  # not the cluster's
    assert httpx.post(prefill, json={}, headers=inherited, timeout=10).status_code == 401
    keyed = httpx.post(prefill, json={}, headers={CLUSTER_KEY_HEADER: key}, timeout=10)
    assert keyed.status_code == 400 and keyed.json()["error"]["param"] == "room"


def test_sigterm_stops_every_child_and_exits_0(launched: Launched) -> None:
    assert all(is_alive(pid) for pid in launched.pids.values())
    launched.proc.send_signal(signal.SIGTERM)
    assert launched.proc.wait(timeout=120) == 0
    assert not [name for name, pid in launched.pids.items() if is_alive(pid)]
    for url in launched.urls.values():
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=5)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--disaggregation-decode-enable-hicache",), "--disaggregation-decode-enable-radix-cache"),
        (("--rank", "3"), "--rank"),
        (("--page-size", "0"), "--page-size"),
        (("--no-such-flag",), "--no-such-flag"),
        (("--num-decode", "0"), "--num-decode"),
        (("--rank-devices", "cpu"), "--rank-devices"),  # one device for two ranks
        (("--rank-devices", "gpu0", "cpu"), "--rank-devices"),
        (("--rank-devices", "cpu", "cpu", "--device", "cpu"), "--rank-devices"),
    ],
)
def test_bad_flags_are_refused_before_anything_starts(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], named: str
) -> None:
    # In process: the CLI path of `kvstrata launch` up to the point it would start children.
    with pytest.raises(SystemExit) as exited:
        main(["launch", "--model", str(tiny_llama), "--port", "0", *flags])
    assert exited.value.code == 2
    output = capsys.readouterr()
    assert named in output.err and "ready" not in output.out


def test_a_child_that_cannot_start_stops_the_launch(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()  # a directory, but no model in it
    proc = launch("--model", str(tmp_path / "model"), "--num-prefill", "0", "--port", "0",
                  "--log-dir", str(tmp_path / "logs"))  # fmt: skip
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "rank 0 exited with status" in output
    assert "config.json not found" in output  # the child's own log tail, printed


def test_rank_flags_are_split_by_role(tiny_llama: Path) -> None:
    storage = ("--hicache-storage-backend", "file", "--hicache-storage-dir", "/tmp/l3")
    decode_cache = ("--disaggregation-decode-enable-radix-cache",
                    "--disaggregation-decode-enable-hicache")  # fmt: skip
    # Flags come out in config field order, each role's own.
    split = split_rank_flags(str(tiny_llama), ["--page-size", "32", *decode_cache, *storage],
                             num_prefill=1, router_options={"api_key": "k"})  # fmt: skip
    assert split.prefill == ("--page-size", "32")  # the router's key stays the router's
    assert split.decode == ("--page-size", "32", *storage, *decode_cache)
    assert split.api_key is None
    # Prefill ranks with their own hierarchical cache also get the --hicache-* flags.
    split = split_rank_flags(str(tiny_llama), ["--enable-hierarchical-cache", *decode_cache,
                             *storage], num_prefill=1, router_options={})  # fmt: skip
    assert split.prefill == ("--enable-hierarchical-cache", *storage)
    assert split.decode == (*storage, *decode_cache)
    with pytest.raises(ConfigError, match="--num-prefill"):
        split_rank_flags(str(tiny_llama), list(decode_cache), num_prefill=0, router_options={})
    with pytest.raises(ConfigError, match="--disaggregation-decode-enable-radix-cache"):
        split_rank_flags(str(tiny_llama), list(decode_cache[1:]), num_prefill=1,
                         router_options={})  # fmt: skip
