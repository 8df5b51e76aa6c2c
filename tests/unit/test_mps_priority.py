"""`--mps-client-priority`: a prefill rank asks MPS for below-normal priority by default
(so a decode rank sharing its GPU steps first), other ranks normal; an explicit flag wins
over the environment, `auto` keeps what the environment says. `--mps-prefill-sm-percent`
limits a prefill rank's SM share, and only a prefill rank's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstrata.config import EngineConfig
from kvstrata.engine.memory import MPS_PRIORITY_ENV, MPS_SM_PERCENT_ENV, apply_mps_priority


@pytest.mark.parametrize(
    ("mode", "flag", "env", "want"),
    [
        ("prefill", "auto", None, "1"),
        ("decode", "auto", None, "0"),
        ("null", "auto", None, "0"),
        ("prefill", "normal", None, "0"),
        ("decode", "below_normal", None, "1"),
        ("prefill", "auto", "0", "0"),  # the environment's choice stands under auto
        ("decode", "below_normal", "0", "1"),  # the flag wins over it
    ],
)
def test_priority_by_role_flag_and_environment(
    mode: str,
    flag: str,
    env: str | None,
    want: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if env is None:
        monkeypatch.delenv(MPS_PRIORITY_ENV, raising=False)
    else:
        monkeypatch.setenv(MPS_PRIORITY_ENV, env)
    config = EngineConfig.from_flags(
        model=str(tmp_path), disaggregation_mode=mode, mps_client_priority=flag
    )
    assert apply_mps_priority(config) == want
    assert os.environ[MPS_PRIORITY_ENV] == want


def test_an_unknown_priority_is_refused_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="--mps-client-priority"):
        EngineConfig.from_flags(model=str(tmp_path), mps_client_priority="high")


@pytest.mark.parametrize(("mode", "want"), [("prefill", "60"), ("decode", None), ("null", None)])
def test_only_a_prefill_rank_limits_its_sm_share(
    mode: str, want: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(MPS_SM_PERCENT_ENV, raising=False)
    config = EngineConfig.from_flags(
        model=str(tmp_path), disaggregation_mode=mode, mps_prefill_sm_percent=60
    )
    apply_mps_priority(config)
    assert os.environ.get(MPS_SM_PERCENT_ENV) == want


def test_the_default_sets_no_sm_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MPS_SM_PERCENT_ENV, raising=False)
    apply_mps_priority(EngineConfig.from_flags(model=str(tmp_path), disaggregation_mode="prefill"))
    assert MPS_SM_PERCENT_ENV not in os.environ
    with pytest.raises(Exception, match="--mps-prefill-sm-percent"):
        EngineConfig.from_flags(model=str(tmp_path), mps_prefill_sm_percent=0)
