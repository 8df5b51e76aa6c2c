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


def test_demo_shows_every_tier_at_work(tiny_llama: Path) -> None:
    # A real cluster (1 prefill + 2 decode ranks, router) driving 6 conversations x 5 turns.
    demo = kvstrata("demo", "--dir", str(tiny_llama))
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "transferred prompt tokens a prefill rank computed and sent over" in demo.stdout
    row = re.compile(r"^" + r"\s+(\d+)" * 11 + r"$")
    turns = [[int(g) for g in m.groups()] for line in demo.stdout.splitlines()
             if (m := row.match(line))]  # fmt: skip
    assert len(turns) == 30
    for _conv, _turn, rank, prompt, l1, l2, l3, computed, transferred, _out, _ms in turns:
        assert rank in (0, 1)  # the decode rank that answered
        assert l1 + l2 + l3 + computed + transferred == prompt
    assert turns[0][:2] == [1, 1] and sum(turns[0][4:7]) == 0  # nothing cached yet
    for conv in range(1, 7):  # round robin over 6 conversations keeps each on one rank
        assert len({t[2] for t in turns if t[0] == conv}) == 1
    before_flush = [t for t in turns if t[1] < 5]
    after_flush = [t for t in turns if t[1] == 5]
    assert sum(t[5] for t in before_flush) > 0, "no turn found its pages in L2"
    assert all(t[5] == 0 and t[6] > 0 for t in after_flush)  # L1 and L2 flushed: L3 only
    summary = dict(re.findall(r"^  (L[123]): (\d+) of", demo.stdout, re.MULTILINE))
    assert sorted(summary) == ["L1", "L2", "L3"] and all(int(v) > 0 for v in summary.values())
