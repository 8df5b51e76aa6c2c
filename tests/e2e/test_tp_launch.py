"""`kvstrata launch` with tensor-parallel ranks (issue 32): `--tp-size N` among the rank
flags gives each rank N workers, `--rank-devices` lays out N consecutive CUDA devices per
rank (checked before anything starts); two unified TP 2 ranks behind the router answer
as one TP 1 engine does."""

from __future__ import annotations

import re
import signal
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
    with pytest.raises(ConfigError, match="--tp-size 2 runs unified ranks only"):
        split_rank_flags(str(tiny_llama), ["--tp-size", "2"], 1, {})


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
