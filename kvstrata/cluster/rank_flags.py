"""The rank flags of `kvstrata launch`: validated once, before any child starts, and
split by the role that accepts them (prefill, decode, or unified ranks)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from kvstrata.config import (
    ConfigError,
    EngineConfig,
    ServerConfig,
    add_config_args,
    flag,
    to_argv,
)
from kvstrata.config.engine_flags import ALIASED_FLAGS

# Set per child by the launcher, so not accepted among the rank flags (the cluster key is
# one the launcher generates for every cluster).
_LAUNCHER_RANK_FIELDS = (
    "model",
    "host",
    "port",
    "rank",
    "disaggregation_mode",
    "cluster_key",
    "cluster_key_file",
)


@dataclass(frozen=True)
class RankFlags:
    """The rank flags given to launch, split by the role that accepts them."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]  # unified ranks when there are no prefill ranks
    api_key: str | None  # a rank key given as a rank flag (read from its file, if one)
    tp_size: int = 1  # devices per rank (--tp-size)


def split_rank_flags(
    model: str, rank_args: Sequence[str], num_prefill: int, router_options: Mapping[str, Any]
) -> RankFlags:
    """Validate the rank flags and give each role the ones it accepts:
    `--disaggregation-decode-*` go only to decode ranks, and the cache flags they are
    decode spellings of (`--enable-hierarchical-cache`, `--disable-radix-cache`,
    `--hicache-ratio`, `--hicache-size`, `--hicache-write-policy`) only to prefill ranks,
    which get `--hicache-*` only along with `--enable-hierarchical-cache`. The router's
    `--log-level`, `--max-body-bytes` and `--otlp-traces-endpoint` (one trace per request
    needs every hop) apply to the ranks too; its `--api-key` does not
    (the ranks get a key of their own, see `launch_cluster`). Raises ConfigError."""
    parser = argparse.ArgumentParser(
        prog="rank flags", add_help=False, allow_abbrev=False, exit_on_error=False
    )
    add_config_args(parser, EngineConfig)
    add_config_args(parser, ServerConfig)
    try:
        namespace, unknown = parser.parse_known_args(list(rank_args))
    except argparse.ArgumentError as e:
        raise ConfigError(str(e)) from e
    if unknown:
        raise ConfigError(f"not a rank flag: {' '.join(unknown)} (see kvstrata serve --help)")
    values = {k: v for k, v in vars(namespace).items() if v is not None}
    for name in _LAUNCHER_RANK_FIELDS:
        if name in values:
            raise ConfigError(f"{flag(name)} is set per rank by kvstrata launch; drop it")
    for name in ("log_level", "max_body_bytes", "otlp_traces_endpoint", "session_id_from_user"):
        if router_options.get(name) is not None:
            values.setdefault(name, router_options[name])
    decode_only = [k for k in values if k.startswith("disaggregation_decode_")]
    if num_prefill == 0 and decode_only:
        raise ConfigError(
            f"{flag(decode_only[0])} is for decode ranks of a PD cluster (--num-prefill >= 1); "
            "unified ranks use --enable-hierarchical-cache and --disable-radix-cache"
        )
    prefill = {
        k: v
        for k, v in values.items()
        if k not in decode_only
        and (not k.startswith("hicache_") or values.get("enable_hierarchical_cache"))
    }
    # In a PD cluster the main cache flags describe the prefill ranks' cache and the
    # decode spellings the decode ranks' (on one rank they would be one setting).
    decode = (
        values if num_prefill == 0 else {k: v for k, v in values.items() if k not in ALIASED_FLAGS}
    )
    roles = [("prefill", prefill), ("decode", decode)] if num_prefill else [("null", decode)]
    tp_size = 1
    for mode, role_values in roles:  # refuse bad values and combinations before any start
        engine_flags = {k: v for k, v in role_values.items() if k in EngineConfig.flag_names()}
        config = EngineConfig.from_flags(**engine_flags, model=model, disaggregation_mode=mode)
        tp_size = config.model.tp_size
        server = _build(ServerConfig, role_values)  # reads an --api-key-file
    # The rank key reaches the ranks through a key file the launcher writes, never argv.
    prefill, decode = (_without_key(role) for role in (prefill, decode))
    return RankFlags(to_argv(prefill), to_argv(decode), server.api_key, tp_size)


def _without_key(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k not in ("api_key", "api_key_file")}


def _build(cls: type, values: Mapping[str, Any], **fixed: Any) -> Any:
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names}, **fixed)
