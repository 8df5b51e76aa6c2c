"""How a config field becomes a command-line flag and back: `opt` (a field with help text
and choices), `flag`, `add_config_args`, `config_from_args`, and the checks every config
class shares (`ConfigError`, `check_choices`, `check_device`)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from collections.abc import Mapping
from dataclasses import field
from typing import Any, TypeVar

T = TypeVar("T")


def opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with CLI help text (and optional choices)."""
    return field(default=default, metadata={"help": help, "choices": choices})


def check_device(value: str, option: str) -> None:
    """Raise ConfigError naming `option` unless `value` is auto, cpu, cuda or cuda:N."""
    if value not in ("auto", "cpu", "cuda") and re.fullmatch(r"cuda:\d+", value) is None:
        raise ConfigError(f"{option} must be auto, cpu, cuda or cuda:N, got {value!r}")


class ConfigError(ValueError):
    """An invalid option value or combination; the message names the flag(s)."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_choices(config: Any) -> None:
    for f in dataclasses.fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        if choices and value not in choices:
            raise ConfigError(f"{flag(f.name)} must be one of {', '.join(choices)}; got {value!r}")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1 and type(None) in typing.get_args(tp):
        return args[0], True
    return tp, False


def add_config_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one CLI flag per field of the config dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        tp, _ = _unwrap_optional(hints[f.name])
        help_text = f.metadata.get("help", "")
        if tp is bool:
            group.add_argument(
                flag(f.name),
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{help_text} (default: {f.default})",
            )
            continue
        # A tuple field (e.g. a list of URLs) takes one or more values: --flag A B.
        is_list = typing.get_origin(tp) is tuple
        group.add_argument(
            flag(f.name),
            dest=f.name,
            type=typing.get_args(tp)[0] if is_list else tp,
            nargs="+" if is_list else None,
            default=None,
            choices=f.metadata.get("choices"),
            help=f"{help_text} (default: {f.default})",
        )


def config_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Build `cls` from parsed flags; flags left unset keep the dataclass default."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if getattr(args, f.name, None) is not None
    }
    values.update(overrides)
    return cls(**values)


def to_argv(values: Mapping[str, Any]) -> tuple[str, ...]:
    """Config field values as the flags that set them (the inverse of `config_from_args`)."""
    argv: list[str] = []
    for name, value in values.items():
        if isinstance(value, bool):
            argv.append(flag(name) if value else "--no-" + flag(name)[2:])
        elif isinstance(value, (list, tuple)):
            argv += [flag(name), *map(str, value)]
        else:
            argv += [flag(name), str(value)]
    return tuple(argv)
