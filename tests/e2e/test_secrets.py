"""Keys stay off command lines: `kvstrata launch` hands its children the generated rank key
and the client key as 0600 files (no process's /proc/PID/cmdline holds either), ranks
refuse callers without the rank key, a key given in argv is warned about, and
`--api-key-file` / `--rank-api-key-file` are read, checked and refused like flags."""

from __future__ import annotations

import argparse
import logging
import re
import signal
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from test_launch import RANK_FLAGS, launch, read_until_ready

from kvstrata.config import ConfigError, RouterConfig, ServerConfig, add_config_args
from kvstrata.config.options import config_from_args

CLIENT_KEY = "client-key-7f3a9c"
# The launcher's line per child; unified ranks are plain "rank N".
CHILD_LINE = re.compile(r"^((?:prefill |decode )?rank \d|router): (http://\S+) \(pid (\d+)")
UNIFIED_FLAGS = ("--page-size", "16", "--num-kv-pages", "256", "--max-model-len", "1024")
DECODE = ("http://127.0.0.1:2",)


@dataclass
class Cluster:
    launcher_pid: int
    urls: dict[str, str]
    pids: dict[str, int]
    output: list[str]
    rank_key_path: Path


def cmdlines() -> dict[int, bytes]:
    """Every process's command line that can be read (processes come and go meanwhile)."""
    lines = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                lines[int(entry.name)] = (entry / "cmdline").read_bytes()
            except OSError:
                continue
    return lines


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("secrets-logs")
    # The client key is given in argv on purpose: the launcher warns, and must still not
    # pass it on to the router by argv.
    proc = launch("--model", str(tiny_llama), "--num-prefill", "1", "--num-decode", "1",
                  "--port", "0", "--log-dir", str(log_dir), "--api-key", CLIENT_KEY,
                  "--rank-devices", "cpu", "cpu", *RANK_FLAGS,
                  "--disaggregation-decode-local-prefill", "never")  # fmt: skip
    try:
        output = read_until_ready(proc)
        matches = [m for line in output if (m := CHILD_LINE.match(line))]
        pids = {m[1]: int(m[3]) for m in matches}
        argv = (Path("/proc") / str(pids["prefill rank 0"]) / "cmdline").read_bytes().split(b"\0")
        key_path = Path(argv[argv.index(b"--api-key-file") + 1].decode())
        yield Cluster(proc.pid, {m[1]: m[2] for m in matches}, pids, output, key_path)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)


def test_no_process_has_a_key_on_its_command_line(cluster: Cluster) -> None:
    rank_key = cluster.rank_key_path.read_text().strip()
    assert len(rank_key) >= 24 and rank_key != CLIENT_KEY
    # The key file and its directory are the launcher's user's alone.
    assert stat.S_IMODE(cluster.rank_key_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(cluster.rank_key_path.parent.stat().st_mode) == 0o700
    lines = cmdlines()
    assert all(pid in lines for pid in cluster.pids.values())
    for pid, line in lines.items():
        assert rank_key.encode() not in line, f"pid {pid}: {line!r}"
        if pid != cluster.launcher_pid:  # the test put the client key in the launcher's
            assert CLIENT_KEY.encode() not in line, f"pid {pid}: {line!r}"
    assert any("--api-key on the command line is visible" in line for line in cluster.output)


def test_ranks_answer_only_the_rank_key_and_the_router_serves_with_it(cluster: Cluster) -> None:
    rank_key = cluster.rank_key_path.read_text().strip()
    rank_auth = {"authorization": f"Bearer {rank_key}"}
    for name in ("prefill rank 0", "decode rank 0"):
        url = cluster.urls[name]
        assert httpx.get(url + "/get_load", timeout=10).status_code == 401
        client_auth = {"authorization": f"Bearer {CLIENT_KEY}"}
        assert httpx.get(url + "/get_load", headers=client_auth, timeout=10).status_code == 401
        assert httpx.get(url + "/get_load", headers=rank_auth, timeout=10).status_code == 200
    body = {"input_ids": [3, 4, 5, 6, 7], "sampling_params": {"max_new_tokens": 4}}
    router = cluster.urls["router"]
    assert httpx.post(router + "/generate", json=body, timeout=120).status_code == 401
    answer = httpx.post(router + "/generate", json=body, timeout=120,
                        headers={"authorization": f"Bearer {CLIENT_KEY}"})  # fmt: skip
    assert answer.status_code == 200, answer.text  # router -> decode -> prefill, all keyed
    decode_metrics = httpx.get(
        cluster.urls["decode rank 0"] + "/metrics", headers=rank_auth, timeout=10
    ).text
    assert "kvstrata_transferred_tokens_total 5.0" in decode_metrics  # the prefill rank's


def test_stopping_the_cluster_removes_the_key_files(tiny_llama: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "client.key"
    key_file.write_text(CLIENT_KEY + "\n")
    key_file.chmod(0o600)
    proc = launch("--model", str(tiny_llama), "--num-prefill", "0", "--num-decode", "1",
                  "--port", "0", "--log-dir", str(tmp_path / "logs"), "--api-key-file",
                  str(key_file), "--rank-devices", "cpu", *UNIFIED_FLAGS)  # fmt: skip
    try:
        output = read_until_ready(proc)
        matches = [m for line in output if (m := CHILD_LINE.match(line))]
        pids = {m[1]: int(m[3]) for m in matches}
        router = next(m[2] for m in matches if m[1] == "router")
        argv = (Path("/proc") / str(pids["rank 0"]) / "cmdline").read_bytes().split(b"\0")
        rank_key_path = Path(argv[argv.index(b"--api-key-file") + 1].decode())
        assert rank_key_path.is_file()
        auth = {"authorization": f"Bearer {CLIENT_KEY}"}
        assert httpx.get(router + "/v1/models", headers=auth, timeout=10).status_code == 200
        assert not any("on the command line is visible" in line for line in output)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    assert not rank_key_path.parent.exists()


def parse(cls: type, argv: list[str]) -> object:
    parser = argparse.ArgumentParser()
    add_config_args(parser, cls)
    return config_from_args(cls, parser.parse_args(argv))


def test_key_files_are_read_and_keys_in_argv_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key_file = tmp_path / "k"
    key_file.write_text("  secret-1  \nsecond line ignored\n")
    key_file.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="kvstrata.config"):
        server = parse(ServerConfig, ["--api-key-file", str(key_file)])
        router = parse(RouterConfig, ["--decode", *DECODE, "--rank-api-key-file", str(key_file)])
    assert isinstance(server, ServerConfig) and server.api_key == "secret-1"
    assert isinstance(router, RouterConfig) and router.rank_api_key == "secret-1"
    assert router.api_key is None
    assert caplog.records == []
    with caplog.at_level(logging.WARNING, logger="kvstrata.config"):
        parse(RouterConfig, ["--decode", *DECODE, "--rank-api-key", "x", "--api-key", "y"])
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "--rank-api-key-file" in warned[1]
    caplog.clear()
    key_file.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="kvstrata.config"):
        ServerConfig(api_key_file=str(key_file))
    assert "readable by other users" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("\n", {}, "holds no key"),
        (None, {}, "cannot read"),
        ("k1\n", {"api_key": "k2"}, "give --api-key or --api-key-file, not both"),
    ],
    ids=["empty", "missing", "both"],
)
def test_bad_key_files_are_refused_naming_the_flag(
    tmp_path: Path, content: str | None, extra: dict, message: str
) -> None:
    key_file = tmp_path / "k"
    if content is not None:
        key_file.write_text(content)
    with pytest.raises(ConfigError, match=message) as refused:
        ServerConfig(api_key_file=str(key_file), **extra)
    assert "--api-key" in str(refused.value)
