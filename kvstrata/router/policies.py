"""The `--load-balance-method` names and `make_policy`, the one place that maps a name to a
policy class. The prefill side always uses `shortest_queue` (requests, then tokens)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstrata.router.cache_aware import Auto, CacheAware
from kvstrata.router.policy import Policy, RoundRobin, ShortestQueue, TotalTokens
from kvstrata.router.ttft import Ttft

if TYPE_CHECKING:
    from kvstrata.config import RouterConfig

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Auto, RoundRobin, ShortestQueue, TotalTokens, CacheAware, Ttft)
}


def make_policy(config: RouterConfig) -> Policy:
    try:
        policy_cls = POLICIES[config.load_balance_method]
    except KeyError:
        raise ValueError(
            f"--load-balance-method {config.load_balance_method} has no implementation"
        ) from None
    return policy_cls.from_config(config)
