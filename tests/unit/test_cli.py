"""The `kvstrata` command line as a user runs it: real subprocesses."""

from __future__ import annotations

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
    demo = kvstrata("demo", "--dir", str(tiny_llama))
    assert demo.returncode == 0, demo.stderr
    turns = [line for line in demo.stdout.splitlines() if line.startswith("turn ")]
    assert len(turns) == 3
    cached = [int(line.split("cached ")[1].split(",")[0]) for line in turns]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]
