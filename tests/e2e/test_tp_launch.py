"""`kvstrata launch` with tensor-parallel ranks (issue 32): `--tp-size N` among the rank
flags gives each rank N workers, `--rank-devices` lays out N consecutive CUDA devices per
rank (checked before anything starts); two unified TP 2 ranks behind the router answer
as one TP 1 engine does, and so do a TP 2 prefill rank and two TP 2 decode ranks; when a
decode rank's follower worker dies, that rank ends (its supervisor starts the whole rank
again) and the router sends the requests to the other decode rank meanwhile."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_launch import CHILD_LINE, launch, read_until_ready

from kvstrata.cluster.launch import rank_device_groups
from kvstrata.cluster.launch_config import LaunchConfig
from kvstrata.cluster.rank_flags import split_rank_flags
from kvstrata.config import ConfigError
from kvstrata.core import SamplingParams
from kvstrata.llm import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from suite_guards import process_tree

RANK_LINE = re.compile(r"^([\w ]*rank \d): (http://\S+)")


def test_rank_devices_are_grouped_per_tp_rank(tiny_llama: Path) -> None:
    config = LaunchConfig(model=str(tiny_llama), num_prefill=0, num_decode=2)
    assert rank_device_groups(["cuda:0", "cuda:1", "cuda:2", "cuda:3"], config, 2) == [
        "cuda:0",
        "cuda:2",
    ]
    assert rank_device_groups(["cuda:1", "cuda:0"], config, 1) == ["cuda:1", "cuda:0"]
    with pytest.raises(ConfigError, match="consecutive CUDA indexes"):
        rank_device_groups(["cuda:0", "cuda:2", "cuda:4", "cuda:5"], config, 2)
    with pytest.raises(ConfigError, match="needs 2 device\\(s\\) per rank for 2 ranks"):
        rank_device_groups(["cuda:0", "cuda:1"], config, 2)
    flags = split_rank_flags(str(tiny_llama), ["--tensor-parallel-size", "2"], 0, {})
    assert flags.tp_size == 2
    assert split_rank_flags(str(tiny_llama), ["--tp-size", "2"], 1, {}).tp_size == 2  # PD too


def test_two_tp2_ranks_behind_the_router_answer_as_tp1(tiny_llama: Path, tmp_path: Path) -> None:
    proc = launch(
        "--model",
        str(tiny_llama),
        "--num-prefill",
        "0",
        "--num-decode",
        "2",
        "--port",
        "0",
        "--log-dir",
        str(tmp_path),
        "--tp-size",
        "2",
        "--page-size",
        "16",
        "--num-kv-pages",
        "128",
        "--log-level",
        "warning",
    )
    try:
        output = read_until_ready(proc)
        urls = {m[1]: m[2] for line in output if (m := CHILD_LINE.match(line))}
        ranks = [m[2] for line in output if (m := RANK_LINE.match(line))]
        llm = LLM(str(tiny_llama), page_size=16, num_kv_pages=128)
        params = SamplingParams(max_tokens=8, temperature=0)
        with httpx.Client(base_url=urls["router"], timeout=120) as http:
            for n in (5, 21, 40):
                prompt = [(3 * i + n) % 500 + 1 for i in range(n)]
                body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8}}
                response = http.post(
                    "/generate",
                    json=body | {"sampling_params": {"max_new_tokens": 8, "temperature": 0}},
                )
                assert response.status_code == 200, response.text
                (want,) = llm.generate(input_ids=[prompt], sampling_params=params)
                assert response.json()["output_ids"] == want.output_ids
        assert len(ranks) == 2
        for url in ranks:
            info = httpx.get(url + "/server_info", timeout=10).json()
            assert info["engine_config"]["tp_size"] == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return None


def test_pd_between_tp2_ranks_survives_a_dead_follower(tiny_llama: Path, tmp_path: Path) -> None:
    proc = launch(
        *("--model", str(tiny_llama), "--num-prefill", "1", "--num-decode", "2"),
        *("--port", "0", "--log-dir", str(tmp_path), "--load-poll-interval-s", "0.2"),
        *("--tp-size", "2", "--page-size", "16", "--num-kv-pages", "128"),
        *("--disaggregation-decode-enable-radix-cache", "--log-level", "warning"),
    )
    try:
        output = read_until_ready(proc)
        matches = [m for line in output if (m := CHILD_LINE.match(line))]
        urls, pids = {m[1]: m[2] for m in matches}, {m[1]: int(m[3]) for m in matches}
        llm = LLM(str(tiny_llama), page_size=16, num_kv_pages=128)
        params = SamplingParams(max_tokens=8, temperature=0)
        prompts = [[(3 * i + n) % 500 + 1 for i in range(n)] for n in (5, 21, 40, 57)]
        wants = [out.output_ids for out in llm.generate(input_ids=prompts, sampling_params=params)]
        body = {"sampling_params": {"max_new_tokens": 8, "temperature": 0}}

        def answers(http: httpx.Client) -> list[list[int]]:
            got = []
            for prompt in prompts:
                response = http.post("/generate", json=body | {"input_ids": prompt})
                assert response.status_code == 200, response.text
                got.append(response.json()["output_ids"])
            return got

        with httpx.Client(base_url=urls["router"], timeout=120) as http:
            assert answers(http) == wants
            (follower,) = [
                p
                for p in process_tree(pids["decode rank 0"])
                if "spawn_main" in p.command and "resource_tracker" not in p.command
            ]
            os.kill(follower.pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while _health(urls["decode rank 0"]) == 200:  # it ends on its own, idle
                assert time.monotonic() < deadline, "a rank with a dead worker stays healthy"
                time.sleep(0.1)
            assert answers(http) == wants  # the other decode rank serves meanwhile
            while _health(urls["decode rank 0"]) != 200:  # restarted as a whole rank
                assert time.monotonic() < deadline + 120, "the rank was not restarted"
                time.sleep(0.5)
            assert answers(http) == wants
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    assert "kvstrata-tp1" in "".join(p.read_text() for p in tmp_path.glob("*.log"))
