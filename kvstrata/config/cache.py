"""The cache options every role reads (radix cache, L2, L3) and SGLang's decode-mode
spellings of them (`--disaggregation-decode-enable-radix-cache`, `-*hicache*`): aliases
folded onto the main fields once, when an `EngineConfig` is made; nothing later reads them."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from kvstrata.config.options import ConfigError, flag
from kvstrata.config.secret import Secret

if TYPE_CHECKING:
    from kvstrata.config.engine import EngineConfig

# A decode spelling -> the main field it sets (same default, same meaning).
DECODE_CACHE_ALIASES = {
    "disaggregation_decode_enable_hicache": "enable_hierarchical_cache",
    "disaggregation_decode_hicache_ratio": "hicache_ratio",
    "disaggregation_decode_hicache_size": "hicache_size",
    "disaggregation_decode_hicache_write_policy": "hicache_write_policy",
}
# Sets `disable_radix_cache` with the opposite sense: decode ranks keep no radix cache
# unless asked (SGLang's default), every other role keeps one unless told not to.
RADIX_ALIAS = "disaggregation_decode_enable_radix_cache"
RADIX_FIELD = "disable_radix_cache"
# The main fields a decode spelling stands for, the radix switch included.
ALIASED_FIELDS = (RADIX_FIELD, *DECODE_CACHE_ALIASES.values())


def fold_decode_aliases(config: EngineConfig) -> None:
    """Set the main cache fields to the settings in force. `disable_radix_cache` None
    means the role's default. On a decode rank each decode spelling and its main flag
    are one setting: whichever is given sets both (so the two spellings make equal
    configs); both given with different values is refused. Elsewhere a decode spelling
    stays as given, for the mode check to refuse."""
    decode = config.disaggregation_mode == "decode"
    radix_alias = getattr(config, RADIX_ALIAS)
    disable_radix = config.disable_radix_cache
    if disable_radix is None:
        disable_radix = not radix_alias if decode else False
    elif decode and radix_alias and disable_radix:
        raise ConfigError(f"give {flag(RADIX_ALIAS)} or {flag(RADIX_FIELD)}, not both")
    _set(config, RADIX_FIELD, disable_radix)
    if not decode:
        return
    _set(config, RADIX_ALIAS, not disable_radix)
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for alias, main in DECODE_CACHE_ALIASES.items():
        alias_value, main_value = getattr(config, alias), getattr(config, main)
        both_given = alias_value != defaults[alias] and main_value != defaults[main]
        if both_given and alias_value != main_value:
            raise ConfigError(
                f"{flag(alias)} and {flag(main)} are one setting on a decode rank: give one "
                f"(got {alias_value!r} and {main_value!r})"
            )
        value = main_value if alias_value == defaults[alias] else alias_value
        _set(config, main, value)
        _set(config, alias, value)


def check_cache(config: EngineConfig) -> None:
    """The cache options' values and combinations, on the folded main fields; a message
    names the decode spelling too on a decode rank."""
    ratio, size_gb = config.hicache_ratio, config.hicache_size
    if ratio <= 0:
        raise ConfigError(f"{_flags(config, 'hicache_ratio')} must be > 0, got {ratio}")
    if size_gb < 0:
        raise ConfigError(f"{_flags(config, 'hicache_size')} must be >= 0, got {size_gb}")
    if config.hicache_io_threads < 1:
        raise ConfigError(f"--hicache-io-threads must be >= 1, got {config.hicache_io_threads}")
    if config.hicache_storage_backend != "none" and not config.enable_hierarchical_cache:
        raise ConfigError(
            f"--hicache-storage-backend needs {_flags(config, 'enable_hierarchical_cache')} "
            "(L3 sits behind L2)"
        )
    if config.enable_hierarchical_cache and config.disable_radix_cache:
        hicache = _flags(config, "enable_hierarchical_cache")
        if config.disaggregation_mode == "decode":
            raise ConfigError(
                f"{hicache} needs the radix cache, which decode ranks keep only when asked: "
                f"give {flag(RADIX_ALIAS)}"
            )
        raise ConfigError(f"{hicache} needs the radix cache: drop --disable-radix-cache")
    if config.hicache_io_backend == "kernel" and config.device == "cpu":
        raise ConfigError("--hicache-io-backend kernel needs CUDA; use direct on --device cpu")
    if config.hicache_storage_backend == "file" and not config.hicache_storage_dir:
        raise ConfigError("--hicache-storage-backend file needs --hicache-storage-dir")
    try:
        extra = json.loads(config.hicache_storage_backend_extra_config)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--hicache-storage-backend-extra-config is not JSON: {e}") from e
    if not isinstance(extra, dict):
        raise ConfigError("--hicache-storage-backend-extra-config must be a JSON object")
    _check_storage_trust(config)


def _check_storage_trust(config: EngineConfig) -> None:
    """The L3 page key and the `file` directory's access flags belong to an L3 of theirs."""
    if config.hicache_storage_key is not None and config.hicache_storage_backend == "none":
        raise ConfigError(
            "--hicache-storage-key-file (--hicache-storage-key) needs --hicache-storage-backend"
        )
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for name in ("hicache_storage_file_mode", "hicache_storage_allow_shared_dir"):
        if getattr(config, name) != defaults[name] and config.hicache_storage_backend != "file":
            raise ConfigError(f"{flag(name)} needs --hicache-storage-backend file")


def hide_storage_key(config: EngineConfig) -> None:
    """Hold the resolved L3 page secret as a `Secret`: /server_info lists the engine
    config (dataclasses.asdict) and errors print its repr; neither may show the key."""
    key: object = config.hicache_storage_key
    if isinstance(key, str):
        if not key.strip():
            raise ConfigError("--hicache-storage-key is empty")
        _set(config, "hicache_storage_key", Secret(key))
    elif key is not None and not isinstance(key, Secret):
        raise ConfigError("--hicache-storage-key must be a string")


def _flags(config: EngineConfig, main: str) -> str:
    """The flag of main field `main`, with its decode spelling on a decode rank."""
    if config.disaggregation_mode != "decode":
        return flag(main)
    alias = next(a for a, m in DECODE_CACHE_ALIASES.items() if m == main)
    return f"{flag(main)} ({flag(alias)})"


def _set(config: Any, name: str, value: Any) -> None:
    object.__setattr__(config, name, value)  # the config is frozen once made
