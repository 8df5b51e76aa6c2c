"""`make syslibs` (run by `make install`): Mooncake's system libraries are installed with
apt when root, named in one line otherwise, and left alone with KVSTRATA_SKIP_MOONCAKE=1.
`id` and `apt-get` are stand-ins on PATH, so nothing is installed for real."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ABSENT = "libkvstrata-absent-for-test.so.1"
DEBS = "libibverbs1 librdmacm1 libnuma1"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")


def _make_syslibs(tmp_path: Path, uid: int, libs: str, **env: str) -> tuple[str, str]:
    """Runs `make -s syslibs` with a fake uid and a recording apt-get; returns (stdout,
    the apt-get calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "apt-calls"
    (bin_dir / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    (bin_dir / "apt-get").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    full_env.pop("KVSTRATA_SKIP_MOONCAKE", None)
    full_env.update(env)
    result = subprocess.run(
        ["make", "-s", "-C", str(REPO), "syslibs", f"MOONCAKE_LIBS={libs}"],
        env=full_env,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout, calls.read_text() if calls.exists() else ""


def test_root_installs_the_missing_libraries_with_apt(tmp_path: Path) -> None:
    _, calls = _make_syslibs(tmp_path, 0, ABSENT)
    assert calls.splitlines() == ["update -qq", f"install -y -qq {DEBS}"]


def test_non_root_is_told_the_exact_command(tmp_path: Path) -> None:
    out, calls = _make_syslibs(tmp_path, 1000, ABSENT)
    assert calls == ""
    assert len(out.splitlines()) == 1
    assert f"sudo apt-get install -y {DEBS}" in out


def test_skip_env_checks_nothing(tmp_path: Path) -> None:
    out, calls = _make_syslibs(tmp_path, 0, ABSENT, KVSTRATA_SKIP_MOONCAKE="1")
    assert (out, calls) == ("", "")


def test_present_libraries_need_nothing(tmp_path: Path) -> None:
    # libc is on every machine that runs this suite.
    out, calls = _make_syslibs(tmp_path, 0, "libc.so.6")
    assert (out, calls) == ("", "")
