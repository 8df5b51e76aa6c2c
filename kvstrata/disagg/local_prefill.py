"""Conditional disaggregation: per request, after its prefix match, whether the decode
rank prefills the uncached part itself (local: its own scheduler, in chunks, no room, no
transfer) or sends it to a prefill rank (remote). One class per
`--disaggregation-decode-local-prefill` mode, chosen by `make_local_prefill_policy`."""

from __future__ import annotations

from typing import Protocol

from kvstrata.config import EngineConfig
from kvstrata.disagg.prefill_costs import PathCosts, PrefillDemand, TtftEstimate, defaults_for
from kvstrata.disagg.tpot_budget import TpotBudget


class LocalPrefillPolicy(Protocol):
    name: str

    def prefers_local(self, demand: PrefillDemand) -> bool: ...

    def max_local_tokens(self, demand: PrefillDemand) -> int:
        """The most uncached tokens this rank would prefill itself now (the router's
        `ttft` policy counts no transfer for a request within it)."""
        ...

    def observe_step(self, num_prefill_tokens: int, step_s: float, num_decodes: int) -> None: ...

    def observe_room(
        self,
        num_prompt_tokens: int,
        num_computed_tokens: int,
        room_s: float,
        prefill_s: float,
        send_s: float,
        kv_bytes: int,
    ) -> None: ...

    def metrics(self) -> dict[str, float]: ...


class _Uncalibrated:
    """Policies that decide without measuring."""

    def observe_step(self, num_prefill_tokens: int, step_s: float, num_decodes: int) -> None:
        pass

    def observe_room(
        self,
        num_prompt_tokens: int,
        num_computed_tokens: int,
        room_s: float,
        prefill_s: float,
        send_s: float,
        kv_bytes: int,
    ) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}


class NeverLocal(_Uncalibrated):
    """`never`: every request goes through a prefill rank (classic PD)."""

    name = "never"

    def prefers_local(self, demand: PrefillDemand) -> bool:
        return False

    def max_local_tokens(self, demand: PrefillDemand) -> int:
        return 0


class ThresholdLocal(_Uncalibrated):
    """`threshold`: local when at most `max_tokens` prompt tokens are uncached."""

    name = "threshold"

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens

    def prefers_local(self, demand: PrefillDemand) -> bool:
        return demand.num_uncached_tokens <= self.max_tokens

    def max_local_tokens(self, demand: PrefillDemand) -> int:
        return self.max_tokens


class AutoLocal:
    """`auto`: local when the estimated time to first token of computing here, plus the
    delay it adds to every running decode, is at most the remote path's estimate, and
    the running decodes' TPOT budget is not spent (`TpotBudget`)."""

    name = "auto"

    def __init__(self, costs: PathCosts, max_model_len: int, budget: TpotBudget) -> None:
        self.costs = costs
        self.max_model_len = max_model_len
        self.budget = budget

    def estimate(self, demand: PrefillDemand) -> TtftEstimate:
        return self.costs.estimate(demand)

    def prefers_local(self, demand: PrefillDemand) -> bool:
        if not self.costs.estimate(demand).prefers_local:
            return False
        return self.budget.allows(demand.num_running_reqs)

    def max_local_tokens(self, demand: PrefillDemand) -> int:
        """The break-even length by bisection: the local cost grows faster with the
        uncached length than the remote one (it also delays the running decodes). 0
        while the TPOT budget is spent."""
        if demand.num_running_reqs and self.budget.share > self.budget.budget:
            return 0

        def local_wins(num_tokens: int) -> bool:
            estimate = self.costs.estimate(demand._replace(num_uncached_tokens=num_tokens))
            return estimate.prefers_local

        if not local_wins(0):
            return 0
        low, high = 0, self.max_model_len
        if local_wins(high):
            return high
        while high - low > 1:  # invariant: local wins at low, not at high
            middle = (low + high) // 2
            low, high = (middle, high) if local_wins(middle) else (low, middle)
        return low

    def observe_step(self, num_prefill_tokens: int, step_s: float, num_decodes: int) -> None:
        self.costs.observe_step(num_prefill_tokens, step_s)
        _, s_per_token = self.costs.step.coefficients
        self.budget.observe(num_prefill_tokens * s_per_token, step_s, num_decodes)

    def observe_room(
        self,
        num_prompt_tokens: int,
        num_computed_tokens: int,
        room_s: float,
        prefill_s: float,
        send_s: float,
        kv_bytes: int,
    ) -> None:
        self.costs.observe_room(
            num_prompt_tokens, num_computed_tokens, room_s, prefill_s, send_s, kv_bytes
        )

    def metrics(self) -> dict[str, float]:
        budget = {
            "pd_local_prefill_tpot_share": self.budget.share,
            "pd_local_prefill_tpot_refused": self.budget.num_refused,
        }
        return self.costs.snapshot() | budget


def make_local_prefill_policy(
    config: EngineConfig,
    device_type: str,
    num_params: int,
    kv_bytes_per_token: int,
    max_model_len: int,
) -> LocalPrefillPolicy:
    mode = config.pd.local_prefill
    if mode == "never":
        return NeverLocal()
    if mode == "threshold":
        return ThresholdLocal(config.pd.local_prefill_max_tokens)
    defaults = defaults_for(device_type, config.pd.transfer_backend, num_params)
    chunk_tokens = config.max_prefill_tokens_per_step
    budget = config.scheduler.max_num_batched_tokens
    costs = PathCosts(defaults, kv_bytes_per_token, chunk_tokens, budget)
    return AutoLocal(costs, max_model_len, TpotBudget(config.pd.local_prefill_tpot_budget))
