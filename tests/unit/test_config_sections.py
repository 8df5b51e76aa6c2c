"""Config sections shared between front ends and roles: the `IngressLimits` options a rank
and the router both carry, the cache options every role reads (with SGLang's decode-mode
spellings as aliases), and every sub-command's generated --help."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvstrata.__main__ import build_parser, main
from kvstrata.cluster.rank_flags import split_rank_flags
from kvstrata.config import (
    ConfigError,
    EngineConfig,
    IngressLimits,
    RouterConfig,
    ServerConfig,
    config_from_args,
)

DECODE = ("http://127.0.0.1:1",)


@pytest.mark.parametrize("cls", [ServerConfig, RouterConfig])
def test_both_front_ends_carry_the_ingress_section_unchanged(cls: type) -> None:
    shared = {f.name: (f.default, f.metadata["help"]) for f in dataclasses.fields(IngressLimits)}
    own = {f.name: (f.default, f.metadata["help"]) for f in dataclasses.fields(cls)}
    assert issubclass(cls, IngressLimits)
    assert {name: own[name] for name in shared} == shared


def test_ingress_flags_parse_to_the_same_values_on_serve_and_router(tmp_path: Path) -> None:
    flags = ["--max-body-bytes", "4096", "--new-connections-per-s", "2.5",
             "--new-connections-burst", "7", "--max-connections", "300",
             "--max-connections-per-address", "30", "--keep-alive-timeout-s", "2",
             "--header-timeout-s", "3", "--body-timeout-s", "4",
             "--min-body-bytes-per-s", "512"]  # fmt: skip
    parser = build_parser()
    serve = config_from_args(ServerConfig, parser.parse_args(["serve", "--model", str(tmp_path),
                                                             *flags]))  # fmt: skip
    router = config_from_args(RouterConfig, parser.parse_args(["router", "--decode", *DECODE,
                                                              *flags]))  # fmt: skip
    names = [f.name for f in dataclasses.fields(IngressLimits)]
    assert [getattr(serve, n) for n in names] == [getattr(router, n) for n in names]
    assert [getattr(serve, n) for n in names] == [4096, 2.5, 7, 300, 30, 2.0, 3.0, 4.0, 512.0]


@pytest.mark.parametrize("command", ["generate", "serve", "router", "launch", "bench", "simulate"])
def test_every_sub_command_help_renders(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Help text is %-formatted by argparse: a literal "%" in a field's help once broke it.
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    assert "--help" in capsys.readouterr().out


def _decode_config(model: Path, *flags: str) -> EngineConfig:
    args = build_parser().parse_args(
        ["serve", "--model", str(model), "--disaggregation-mode", "decode", *flags]
    )
    return config_from_args(EngineConfig, args)


def test_a_decode_spelling_and_its_main_flag_are_one_setting(tmp_path: Path) -> None:
    sglang = _decode_config(
        tmp_path, "--disaggregation-decode-enable-radix-cache",
        "--disaggregation-decode-enable-hicache", "--disaggregation-decode-hicache-ratio", "4",
        "--disaggregation-decode-hicache-write-policy", "write_back",
    )  # fmt: skip
    main_flags = _decode_config(
        tmp_path, "--no-disable-radix-cache", "--enable-hierarchical-cache", "--hicache-ratio",
        "4", "--hicache-write-policy", "write_back",
    )  # fmt: skip
    assert sglang == main_flags
    # The main fields hold the settings in force, whichever spelling was given.
    assert (sglang.l1.disable_radix_cache, sglang.l2.enabled) == (False, True)
    assert (sglang.l2.ratio, sglang.l2.write_policy) == (4.0, "write_back")


@pytest.mark.parametrize(("mode", "disabled"), [("null", False), ("prefill", False),
                                                ("decode", True)])  # fmt: skip
def test_the_radix_cache_default_follows_the_role(
    tmp_path: Path, mode: str, disabled: bool
) -> None:
    config = EngineConfig.from_flags(model=str(tmp_path), disaggregation_mode=mode)
    assert config.l1.disable_radix_cache is disabled
    alias = config.flags()["disaggregation_decode_enable_radix_cache"]
    assert alias is (mode == "decode" and not disabled)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"disaggregation_decode_hicache_ratio": 3.0, "hicache_ratio": 4.0},
         "--disaggregation-decode-hicache-ratio and --hicache-ratio are one setting"),
        ({"disaggregation_decode_enable_radix_cache": True, "disable_radix_cache": True},
         "give --disaggregation-decode-enable-radix-cache or --disable-radix-cache"),
        ({"enable_hierarchical_cache": True}, "--disaggregation-decode-enable-radix-cache"),
        ({"disaggregation_decode_enable_radix_cache": True,
          "disaggregation_decode_hicache_size": -1.0},
         r"--hicache-size \(--disaggregation-decode-hicache-size\) must be >= 0"),
    ],
)  # fmt: skip
def test_decode_cache_flags_are_checked_in_either_spelling(
    tmp_path: Path, fields: dict[str, object], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        EngineConfig.from_flags(model=str(tmp_path), disaggregation_mode="decode", **fields)  # type: ignore[arg-type]


def test_a_decode_spelling_needs_decode_mode(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--disaggregation-decode-enable-hicache needs "
                       "--disaggregation-mode decode"):  # fmt: skip
        EngineConfig.from_flags(model=str(tmp_path), disaggregation_decode_enable_hicache=True)


def test_launch_keeps_the_main_cache_flags_for_prefill_ranks(tmp_path: Path) -> None:
    # In a PD cluster the decode spellings are the decode ranks' cache, the main flags the
    # prefill ranks': a decode rank never gets both (on one rank they are one setting).
    flags = ["--enable-hierarchical-cache", "--hicache-ratio", "3", "--disable-radix-cache",
             "--disaggregation-decode-enable-radix-cache"]  # fmt: skip
    with pytest.raises(ConfigError, match="--disable-radix-cache"):  # prefill: L2 needs L1
        split_rank_flags(str(tmp_path), flags, num_prefill=1, router_options={})
    split = split_rank_flags(str(tmp_path), flags[:3] + flags[4:], num_prefill=1,
                             router_options={})  # fmt: skip
    assert split.prefill == ("--enable-hierarchical-cache", "--hicache-ratio", "3.0")
    assert split.decode == ("--disaggregation-decode-enable-radix-cache",)
    # The router's trace endpoint reaches every rank: a trace needs every hop.
    router_options = {"otlp_traces_endpoint": "http://otel:4318"}
    traced = split_rank_flags(str(tmp_path), [], num_prefill=1, router_options=router_options)
    assert traced.prefill == traced.decode == ("--otlp-traces-endpoint", "http://otel:4318")
    # So does --session-id-from-user: ranks name the session as the router does.
    users = split_rank_flags(str(tmp_path), [], 1, router_options={"session_id_from_user": True})
    assert users.prefill == users.decode == ("--session-id-from-user",)
