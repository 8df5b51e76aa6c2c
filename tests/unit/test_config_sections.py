"""Config sections shared between front ends and roles: the `IngressLimits` options a rank
and the router both carry, and every sub-command's generated --help."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvstrata.__main__ import build_parser, main
from kvstrata.config import IngressLimits, RouterConfig, ServerConfig, config_from_args

DECODE = ("http://127.0.0.1:1",)


@pytest.mark.parametrize("cls", [ServerConfig, RouterConfig])
def test_both_front_ends_carry_the_ingress_section_unchanged(cls: type) -> None:
    shared = {f.name: (f.default, f.metadata["help"]) for f in dataclasses.fields(IngressLimits)}
    own = {f.name: (f.default, f.metadata["help"]) for f in dataclasses.fields(cls)}
    assert issubclass(cls, IngressLimits)
    assert {name: own[name] for name in shared} == shared


def test_ingress_flags_parse_to_the_same_values_on_serve_and_router(tmp_path: Path) -> None:
    flags = ["--max-body-bytes", "4096", "--new-connections-per-s", "2.5",
             "--new-connections-burst", "7"]  # fmt: skip
    parser = build_parser()
    serve = config_from_args(ServerConfig, parser.parse_args(["serve", "--model", str(tmp_path),
                                                             *flags]))  # fmt: skip
    router = config_from_args(RouterConfig, parser.parse_args(["router", "--decode", *DECODE,
                                                              *flags]))  # fmt: skip
    names = [f.name for f in dataclasses.fields(IngressLimits)]
    assert [getattr(serve, n) for n in names] == [getattr(router, n) for n in names]
    assert [getattr(serve, n) for n in names] == [4096, 2.5, 7]


@pytest.mark.parametrize("command", ["generate", "serve", "router", "launch", "bench", "simulate"])
def test_every_sub_command_help_renders(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Help text is %-formatted by argparse: a literal "%" in a field's help once broke it.
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    assert "--help" in capsys.readouterr().out
