"""How a config field becomes a command-line flag and back: `opt` (a field with help text
and choices), `flag`, `add_config_args`, `config_from_args`, the checks every config
class shares (`ConfigError`, `check_choices`, `check_device`), and secret fields (keys
read from a `--*-file` flag, so they never sit on a command line)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import stat
import typing
from collections.abc import Mapping
from dataclasses import field
from typing import Any, TypeVar

T = TypeVar("T")
logger = logging.getLogger("kvstrata.config")
KEY_FILE_SUFFIX = "_file"  # secret field `x` is read from the file named by field `x_file`


def opt(
    default: Any,
    help: str,
    choices: tuple[str, ...] | None = None,
    secret: bool = False,
    env: str | None = None,
    flag_name: str | None = None,
) -> Any:
    """A config field with CLI help text (and optional choices), set by the flag
    `--<flag_name>` (default: the field's name). A `secret` field (a key) has a companion
    flag `<flag_name>_file` and is best given through it: argv is readable by every user of
    the host (ps, /proc/PID/cmdline). A secret with an `env` name is read from that
    environment variable when neither flag is given."""
    metadata = {
        "help": help,
        "choices": choices,
        "secret": secret,
        "env": env,
        "flag_name": flag_name,
    }
    return field(default=default, metadata=metadata)


def field_flag(f: dataclasses.Field[Any]) -> str:
    """The name of the flag that sets field `f` (`flag()` of it is the flag itself)."""
    return f.metadata.get("flag_name") or f.name


def key_file_help(secret_name: str) -> str:
    return (
        f"Read {flag(secret_name)} from this file (its first line; keep it mode 0600). Keys "
        f"on the command line are visible to every user of the host; this is not."
    )


def key_file_opt(secret_name: str) -> Any:
    """The `<secret_name>_file` companion of a secret field."""
    return opt(None, key_file_help(secret_name))


def resolve_key_files(config: Any) -> None:
    """In a config's __post_init__: fill each secret field from its `_file` companion
    (else from its environment variable, if it has one and neither flag is given). Giving
    both flags is refused; an unreadable or empty file is a ConfigError naming the flag."""
    for f in dataclasses.fields(config):
        if not f.metadata.get("secret"):
            continue
        path = getattr(config, f.name + KEY_FILE_SUFFIX)
        env = f.metadata.get("env")
        if path is None and getattr(config, f.name) is None and env and env in os.environ:
            key = os.environ[env].strip()
            if not key:
                raise ConfigError(f"the environment variable {env} ({flag(f.name)}) is empty")
            object.__setattr__(config, f.name, key)
        if path is None:
            continue
        key = read_key_file(path, flag(f.name + KEY_FILE_SUFFIX))
        # Equal values are what dataclasses.replace() of a resolved config passes back.
        if getattr(config, f.name) not in (None, key):
            raise ConfigError(f"give {flag(f.name)} or {flag(f.name + KEY_FILE_SUFFIX)}, not both")
        object.__setattr__(config, f.name, key)


def read_key_file(path: str, option: str) -> str:
    """The key in `path`: its first line without surrounding whitespace."""
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            key = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{option}: cannot read {path}: {e}") from e
    if not key:
        raise ConfigError(f"{option}: {path} holds no key (its first line is empty)")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("%s: %s is readable by other users (chmod 600 it)", option, path)
    return key


def warn_secrets_in_argv(cls: type, given: Any) -> None:
    """Warn for each secret flag of `cls` that `given` (a name -> value mapping of flags
    parsed from a command line) sets directly rather than through its `_file` flag."""
    secrets = getattr(cls, "secret_flags", None)
    names = (
        secrets()
        if secrets is not None
        else [f.name for f in dataclasses.fields(cls) if f.metadata.get("secret")]
    )
    for name in names:
        if given.get(name) is not None:
            logger.warning(
                "%s on the command line is visible to every user of this host (ps, "
                "/proc/PID/cmdline); give %s instead",
                flag(name),
                flag(name + KEY_FILE_SUFFIX),
            )


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
            raise ConfigError(
                f"{flag(field_flag(f))} must be one of {', '.join(choices)}; got {value!r}"
            )


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1 and type(None) in typing.get_args(tp):
        return args[0], True
    return tp, False


def add_config_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one CLI flag per field of the config dataclass `cls` (a sectioned config, one
    with `add_flags`, adds its own: a group per section)."""
    if hasattr(cls, "add_flags"):
        cls.add_flags(parser)
        return
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        tp, _ = unwrap_optional(hints[f.name])
        # argparse formats help with %-interpolation: a literal "%" must be doubled.
        help_text = f.metadata.get("help", "").replace("%", "%%")
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
    """Build `cls` from parsed flags; flags left unset keep the dataclass default. A
    sectioned config (one with `from_flags`) is built from its flags by that."""
    from_flags = getattr(cls, "from_flags", None)
    if from_flags is not None:
        names = cls.flag_names()  # type: ignore[attr-defined]
        given = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
        warn_secrets_in_argv(cls, given)
        result: T = from_flags(**given, **overrides)
        return result
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if getattr(args, f.name, None) is not None
    }
    warn_secrets_in_argv(cls, values)
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
