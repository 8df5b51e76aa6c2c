"""The flags of an `EngineConfig`: one per field of its sections (`SECTIONS`, named by each
field's `flag_name`), the `_file` companion of its secret, and SGLang's decode-mode
spellings of five cache flags (aliases, not settings). `resolve_flags` turns the flags
given into the settings in force, a pure function run before any section exists: role
defaults and aliases folded, conflicts refused with the flags named."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import Any, NamedTuple

from kvstrata.config.cache import L1Options, L2Options, L3Options
from kvstrata.config.options import (
    KEY_FILE_SUFFIX,
    ConfigError,
    field_flag,
    flag,
    key_file_help,
    read_key_file,
    unwrap_optional,
)
from kvstrata.config.pd import PDOptions
from kvstrata.config.secret import Secret
from kvstrata.config.sections import ModelOptions, PoolOptions, SchedulerOptions, SpeedOptions
from kvstrata.config.sessions import SessionOptions


class Section(NamedTuple):
    attr: str  # EngineConfig's field
    cls: type
    title: str  # its --help group


SECTIONS = (
    Section("model", ModelOptions, "model"),
    Section("pool", PoolOptions, "KV pool (L1 pages)"),
    Section("scheduler", SchedulerOptions, "scheduler"),
    Section("l1", L1Options, "cache L1: the radix cache"),
    Section("l2", L2Options, "cache L2: host memory"),
    Section("l3", L3Options, "cache L3: storage"),
    Section("sessions", SessionOptions, "agent sessions: their pages between turns"),
    Section("pd", PDOptions, "PD disaggregation"),
    Section("speed", SpeedOptions, "speed tricks (each with its off switch)"),
)
# SGLang's decode spellings -> the flag each stands for on a decode rank (same default).
DECODE_ALIASES = {
    "disaggregation_decode_enable_hicache": "enable_hierarchical_cache",
    "disaggregation_decode_hicache_ratio": "hicache_ratio",
    "disaggregation_decode_hicache_size": "hicache_size",
    "disaggregation_decode_hicache_write_policy": "hicache_write_policy",
}
# Stands for `--disable-radix-cache` with the opposite sense: decode ranks keep no radix
# cache unless asked (SGLang's default), every other role keeps one unless told not to.
RADIX_ALIAS = "disaggregation_decode_enable_radix_cache"
RADIX_FLAG = "disable_radix_cache"
# The flags a decode spelling stands for, the radix switch included.
ALIASED_FLAGS = (RADIX_FLAG, *DECODE_ALIASES.values())
# Other engines' spellings of a flag, on every rank (vLLM's, for the same setting).
PEER_SPELLINGS = {"tensor_parallel_size": "tp_size"}


class FlagField(NamedTuple):
    """A flag that sets one field of one section."""

    section: str  # the EngineConfig field holding the section
    field: dataclasses.Field[Any]
    type: Any  # the flag's value type (a secret's is str)

    @property
    def default(self) -> Any:
        return self.field.default

    @property
    def secret(self) -> bool:
        return bool(self.field.metadata.get("secret"))


@functools.cache
def main_flags() -> dict[str, FlagField]:
    """Flag name -> the section field it sets, in section order."""
    flags: dict[str, FlagField] = {}
    for section in SECTIONS:
        hints = typing.get_type_hints(section.cls)
        for f in dataclasses.fields(section.cls):
            tp = str if f.metadata.get("secret") else unwrap_optional(hints[f.name])[0]
            flags[field_flag(f)] = FlagField(section.attr, f, tp)
    return flags


def alias_default(alias: str) -> Any:
    return False if alias == RADIX_ALIAS else main_flags()[DECODE_ALIASES[alias]].default


@functools.cache
def flag_names() -> frozenset[str]:
    """Every flag `EngineConfig.from_flags` takes: the main ones, the secrets' `_file`
    companions and the aliases."""
    main = main_flags()
    companions = {name + KEY_FILE_SUFFIX for name, f in main.items() if f.secret}
    return frozenset({*main, *companions, *DECODE_ALIASES, RADIX_ALIAS, *PEER_SPELLINGS})


def resolve_flags(given: Mapping[str, Any]) -> dict[str, Any]:
    """The main flags' settings in force, from the flags given (aliases and `_file`
    companions included; a flag left out keeps its default). `--disable-radix-cache` not
    given means the role's default. On a decode rank a decode spelling and its main flag
    are one setting: whichever is given sets it, both given with different values is
    refused; elsewhere a decode spelling is refused. The `_file` companions pass through
    untouched (`read_secrets` reads them). Pure: reads no file and no environment."""
    unknown = sorted(set(given) - flag_names())
    if unknown:
        # As for any unexpected keyword: a caller's bug, not a user's flag (argparse
        # refuses unknown flags before this).
        raise TypeError(f"no such engine option: {unknown[0]!r} ({flag(unknown[0])})")
    main = main_flags()
    values = {name: value for name, value in given.items() if name in main}
    for spelling, name in PEER_SPELLINGS.items():
        if given.get(spelling) is None:
            continue
        if given.get(name) is not None and given[name] != given[spelling]:
            raise ConfigError(
                f"{flag(spelling)} and {flag(name)} are one setting: give one "
                f"(got {given[spelling]!r} and {given[name]!r})"
            )
        values[name] = given[spelling]
    mode = given.get("disaggregation_mode", main["disaggregation_mode"].default)
    decode = mode == "decode"
    given_aliases = [
        alias
        for alias in (RADIX_ALIAS, *DECODE_ALIASES)
        if given.get(alias, alias_default(alias)) != alias_default(alias)
    ]
    if given_aliases and not decode:
        raise ConfigError(
            f"{flag(given_aliases[0])} needs --disaggregation-mode decode (got {mode})"
        )
    radix_alias = bool(given.get(RADIX_ALIAS, False))
    disable_radix = given.get(RADIX_FLAG)
    if disable_radix is None:
        disable_radix = not radix_alias if decode else False
    elif decode and radix_alias and disable_radix:
        raise ConfigError(f"give {flag(RADIX_ALIAS)} or {flag(RADIX_FLAG)}, not both")
    values[RADIX_FLAG] = disable_radix
    for alias, name in DECODE_ALIASES.items() if decode else ():
        default = main[name].default
        alias_value, main_value = given.get(alias, default), given.get(name, default)
        if alias_value != default and main_value != default and alias_value != main_value:
            raise ConfigError(
                f"{flag(alias)} and {flag(name)} are one setting on a decode rank: give one "
                f"(got {alias_value!r} and {main_value!r})"
            )
        values[name] = main_value if alias_value == default else alias_value
    return values


def read_secrets(values: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """`values` with each secret flag read from its `_file` companion in `given` (if
    given) and held as a `Secret`. Refused: both given with different keys, an unreadable
    or empty file, an empty key."""
    values = dict(values)
    for name, f in main_flags().items():
        if not f.secret:
            continue
        companion = name + KEY_FILE_SUFFIX
        key = values.get(name)
        if given.get(companion) is not None:
            from_file = read_key_file(given[companion], flag(companion))
            if key is not None and key != from_file:
                raise ConfigError(f"give {flag(name)} or {flag(companion)}, not both")
            key = from_file
        if isinstance(key, str):
            if not key.strip():
                raise ConfigError(f"{flag(name)} is empty")
            key = Secret(key)
        elif key is not None and not isinstance(key, Secret):
            raise ConfigError(f"{flag(name)} must be a string")
        values[name] = key
    return values


def sections_from(values: Mapping[str, Any]) -> dict[str, Any]:
    """Each section made from the main flags' settings in `values` (the rest: defaults)."""
    fields: dict[str, dict[str, Any]] = {section.attr: {} for section in SECTIONS}
    for name, value in values.items():
        f = main_flags()[name]
        fields[f.section][f.field.name] = value
    return {section.attr: section.cls(**fields[section.attr]) for section in SECTIONS}


def flags_in_force(sections: Mapping[str, Any]) -> dict[str, Any]:
    """Every main flag's setting and every alias's (on a decode rank the value of the flag
    it stands for, elsewhere its default), by flag name: what /server_info lists."""
    values = {name: getattr(sections[f.section], f.field.name) for name, f in main_flags().items()}
    decode = values["disaggregation_mode"] == "decode"
    values[RADIX_ALIAS] = decode and not values[RADIX_FLAG]
    for alias, name in DECODE_ALIASES.items():
        values[alias] = values[name] if decode else alias_default(alias)
    for spelling, name in PEER_SPELLINGS.items():
        values[spelling] = values[name]
    return values


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One argument group per section, one flag per field; a secret's `_file` companion
    beside it; each decode spelling accepted but listed in its main flag's help."""
    aliases_of: dict[str, list[str]] = {name: [] for name in ALIASED_FLAGS}
    for alias, name in ((RADIX_ALIAS, RADIX_FLAG), *DECODE_ALIASES.items()):
        aliases_of[name].append(alias)
    for section in SECTIONS:
        group = parser.add_argument_group(section.title)
        for name, f in main_flags().items():
            if f.section != section.attr:
                continue
            help_text = f.field.metadata.get("help", "")
            default = "the role's" if name == RADIX_FLAG else f.default
            for alias in aliases_of.get(name, ()):
                sense = "the opposite sense" if alias == RADIX_ALIAS else "the same meaning"
                help_text += f" Decode ranks also take it as {flag(alias)} ({sense})."
            for spelling in (s for s, n in PEER_SPELLINGS.items() if n == name):
                help_text += f" Also spelt {flag(spelling)}."
            _add(group, name, f.type, f"{help_text} (default: {default})", f.field)
            if f.secret:
                companion = name + KEY_FILE_SUFFIX
                _add(group, companion, str, key_file_help(name) + " (default: None)", None)
    for alias, name in ((RADIX_ALIAS, RADIX_FLAG), *DECODE_ALIASES.items()):
        main = main_flags()[name]
        _add(
            parser,
            alias,
            bool if alias == RADIX_ALIAS else main.type,
            argparse.SUPPRESS,
            main.field,
        )
    for spelling, name in PEER_SPELLINGS.items():
        _add(parser, spelling, main_flags()[name].type, argparse.SUPPRESS, main_flags()[name].field)


def _add(
    group: argparse._ActionsContainer,
    name: str,
    tp: Any,
    help_text: str,
    field: dataclasses.Field[Any] | None,
) -> None:
    help_text = help_text.replace("%", "%%") if help_text != argparse.SUPPRESS else help_text
    if tp is bool:
        group.add_argument(
            flag(name),
            dest=name,
            action=argparse.BooleanOptionalAction,
            default=None,
            help=help_text,
        )
        return
    choices = field.metadata.get("choices") if field is not None else None
    group.add_argument(
        flag(name), dest=name, type=tp, default=None, choices=choices, help=help_text
    )
