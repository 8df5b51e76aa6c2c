"""Frozen configuration dataclasses: the single source of truth for every option.
The CLI is generated from their fields and help text; invalid values and combinations
are refused in each class's `__post_init__`, with a message naming the flag."""

from kvstrata.config.engine import EngineConfig
from kvstrata.config.h200_costs import (
    H200_KV_BYTES_PER_TOKEN,
    H200_L2_TOKENS_PER_S,
    H200_L3_TOKENS_PER_S,
    H200_PREFILL_TOKENS_PER_S,
    H200_TRANSFER_TOKENS_PER_S,
)
from kvstrata.config.limits import NEW_CONNECTIONS_BURST, NEW_CONNECTIONS_PER_S, IngressLimits
from kvstrata.config.options import (
    ConfigError,
    add_config_args,
    check_choices,
    check_device,
    config_from_args,
    flag,
    opt,
    to_argv,
)
from kvstrata.config.router import RouterConfig
from kvstrata.config.server import ServerConfig

__all__ = [
    "H200_KV_BYTES_PER_TOKEN",
    "H200_L2_TOKENS_PER_S",
    "H200_L3_TOKENS_PER_S",
    "H200_PREFILL_TOKENS_PER_S",
    "H200_TRANSFER_TOKENS_PER_S",
    "NEW_CONNECTIONS_BURST",
    "NEW_CONNECTIONS_PER_S",
    "ConfigError",
    "EngineConfig",
    "IngressLimits",
    "RouterConfig",
    "ServerConfig",
    "add_config_args",
    "check_choices",
    "check_device",
    "config_from_args",
    "flag",
    "opt",
    "to_argv",
]
