"""The `kvstrata` command line as a user runs it: real subprocesses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def kvstrata(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstrata", *args], capture_output=True, text=True, timeout=300
    )


def test_make_tiny_model_then_generate(tmp_path: Path) -> None:
    made = kvstrata("make-tiny-model", str(tmp_path / "m"), "--arch", "qwen3", "--seed", "3")
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "m" / "model.safetensors").is_file()
    gen = kvstrata(
        "generate", "--model", str(tmp_path / "m"), "--prompt", "Hi", "--max-tokens", "4"
    )
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.endswith("\n")


def test_bad_flag_value_names_the_flag(tiny_llama: Path, tmp_path: Path) -> None:
    bad = kvstrata("generate", "--model", str(tiny_llama), "--prompt", "x", "--page-size", "0")
    assert bad.returncode == 2
    assert "--page-size" in bad.stderr
    missing = kvstrata("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert missing.returncode == 2
    assert "--model" in missing.stderr


def test_demo_reports_cache_hits(tiny_llama: Path) -> None:
    # A real cluster (1 prefill + 2 decode ranks, router) driving 3 conversations.
    demo = kvstrata("demo", "--dir", str(tiny_llama))
    assert demo.returncode == 0, demo.stdout + demo.stderr
    turn_line = re.compile(
        r"^conv (\d+) turn (\d+): rank (\d+), prompt (\d+) tokens, cached (\d+) "
        r"\(L1 (\d+) \+ L2 (\d+) \+ L3 (\d+)\), transferred (\d+),"
    )
    turns = [[int(g) for g in m.groups()] for line in demo.stdout.splitlines()
             if (m := turn_line.match(line))]  # fmt: skip
    assert len(turns) == 15  # 3 conversations x 5 turns
    for _conv, _turn, rank, prompt, cached, l1, l2, l3, _transferred in turns:
        assert rank in (0, 1)  # the decode rank that answered
        assert cached == l1 + l2 + l3 and cached < prompt
    assert turns[0][:2] == [1, 1] and turns[0][4] == 0  # the very first turn: nothing cached
    for conv in (1, 2, 3):
        later = [t for t in turns if t[0] == conv and t[1] > 1]
        assert max(t[4] for t in later) > 0, f"conversation {conv} never hit a cache"
