"""The connection flags of `IngressLimits`: bad values are refused naming the flag, on
`kvstrata serve` and `kvstrata router` alike, and `ConnectionBudget` sizes the bounds to
the open-file limit (exact values), refusing a --max-connections that does not fit."""

from __future__ import annotations

from typing import Any

import pytest

from kvstrata.config import ConfigError, IngressLimits, RouterConfig, ServerConfig
from kvstrata.config.limits import ConnectionBudget

DECODE = ("http://127.0.0.1:1",)


@pytest.mark.parametrize(
    ("fields", "flag"),
    [({"max_connections": 0}, "--max-connections"),
     ({"max_connections_per_address": 0}, "--max-connections-per-address"),
     ({"keep_alive_timeout_s": 0.0}, "--keep-alive-timeout-s"),
     ({"header_timeout_s": -1.0}, "--header-timeout-s"),
     ({"body_timeout_s": 0.0}, "--body-timeout-s"),
     ({"min_body_bytes_per_s": 0.0}, "--min-body-bytes-per-s")],
)  # fmt: skip
def test_connection_flags_are_checked_naming_the_flag(fields: dict[str, Any], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        ServerConfig(**fields)
    with pytest.raises(ConfigError, match=flag):
        RouterConfig(decode=DECODE, **fields)


def test_the_default_bounds_fit_the_open_file_limit() -> None:
    # 1024 files: 256 kept for the process, 16 reserved for /health, 7/8 per address.
    assert ConnectionBudget.of(IngressLimits(), 1024, 1) == ConnectionBudget(752, 658, 16, 64)
    # The router: two files a connection (each relayed request holds one to a rank).
    assert ConnectionBudget.of(IngressLimits(), 1024, 2) == ConnectionBudget(368, 322, 16, 64)
    # An eighth of a large limit is kept; the default stops at 16384 connections.
    big = ConnectionBudget.of(IngressLimits(), 65536, 1)
    assert (big.max_connections, big.backlog) == (16384, 2048)
    explicit = IngressLimits(max_connections=100, max_connections_per_address=100)
    assert ConnectionBudget.of(explicit, 1024, 1) == ConnectionBudget(100, 100, 16, 64)


def test_a_bound_past_the_open_file_limit_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"--max-connections 900 does not fit .* 1024"):
        ConnectionBudget.of(IngressLimits(max_connections=900), 1024, 1)
    with pytest.raises(ConfigError, match=r"open-file limit 200 .* raise it"):
        ConnectionBudget.of(IngressLimits(), 200, 1)
