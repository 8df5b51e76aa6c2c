"""What a decode rank has measured of its two ways to fill a prompt's uncached KV: its own
steps (local prefill) and its prefill rank's rooms (remote prefill, then transfer), as
self-calibrating cost fits, and the time-to-first-token estimate of each path."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

# Observations fade with this weight per new one (about the last 20 count).
_DECAY = 0.95
# An observation above this factor times the current prediction is clipped to it: a
# first-use kernel compile or a paused process must not swing a fit for minutes. (Below
# the prediction nothing is clipped: such outliers do not happen, and a pessimistic prior
# must fade fast.)
_CLIP_FACTOR = 4.0
# While no room lands, what the rank learned of the remote path fades back to its prior
# with this half-life where it is worse than the prior: a rank that stopped sending rooms
# (a partition made them slow, local prefill won) gets no new measurement, so without the
# fade one bad spell would keep it prefilling locally for good.
_REMOTE_HALF_LIFE_S = 10.0


class LinearFit:
    """y = intercept + slope * x by exponentially weighted least squares, starting from a
    prior line held as two pseudo-observations (x = 0 and x = `x_ref`) of weight
    `prior_weight` that fade like real ones."""

    def __init__(
        self, intercept: float, slope: float, x_ref: float, prior_weight: float = 2.0
    ) -> None:
        self._sw = self._sx = self._sy = self._sxx = self._sxy = 0.0
        for x in (0.0, x_ref):
            self._add(x, intercept + slope * x, prior_weight / 2)
        self.num_observed = 0

    def _add(self, x: float, y: float, weight: float) -> None:
        self._sw += weight
        self._sx += weight * x
        self._sy += weight * y
        self._sxx += weight * x * x
        self._sxy += weight * x * y

    def observe(self, x: float, y: float) -> None:
        predicted = self.predict(x)
        if predicted > 0:
            y = min(y, predicted * _CLIP_FACTOR)
        for name in ("_sw", "_sx", "_sy", "_sxx", "_sxy"):
            setattr(self, name, getattr(self, name) * _DECAY)
        self._add(x, y, 1.0)
        self.num_observed += 1

    @property
    def coefficients(self) -> tuple[float, float]:
        """(intercept, slope), both >= 0: a cost never shrinks with more tokens."""
        variance = self._sw * self._sxx - self._sx * self._sx
        if variance <= 1e-12 * max(1.0, self._sw * self._sxx):
            return max(self._sy / self._sw, 0.0), 0.0
        slope = max((self._sw * self._sxy - self._sx * self._sy) / variance, 0.0)
        intercept = max((self._sy - slope * self._sx) / self._sw, 0.0)
        return intercept, slope

    def predict(self, x: float) -> float:
        intercept, slope = self.coefficients
        return intercept + slope * x


class Ewma:
    """An exponentially weighted mean starting from a prior value. With `clip`, an
    observation is first held within [value / 4, value x 4] of the current mean, so one
    stall (a partition, a paused process) moves it by at most 15%."""

    def __init__(self, prior: float, clip: bool = False) -> None:
        self.prior = prior
        self.value = prior
        self.clip = clip
        self.num_observed = 0

    def observe(self, value: float) -> None:
        if self.clip and self.value > 0:
            value = min(max(value, self.value / _CLIP_FACTOR), self.value * _CLIP_FACTOR)
        self.value = _DECAY * self.value + (1 - _DECAY) * value
        self.num_observed += 1

    def faded(self, weight: float, worse_if_higher: bool) -> float:
        """The mean with its excess over the prior (in the worse direction) scaled by
        `weight` in [0, 1]; a mean better than the prior stays as it is."""
        if (self.value > self.prior) != worse_if_higher:
            return self.value
        return self.prior + (self.value - self.prior) * weight


@dataclass(frozen=True)
class CostDefaults:
    """Where the fits start, before the rank measured anything (see `defaults_for`)."""

    local_s_per_token: float  # one prefill token in the rank's own step
    step_s: float  # a step's fixed part: the running decodes, launch and host work
    remote_overhead_s: float  # a room's round trip beyond compute and transfer
    remote_s_per_token: float  # the prefill rank's queue and compute per uncached token
    transfer_bytes_per_s: float  # the transport's bandwidth for a room's KV


def defaults_for(device_type: str, transport: str, num_params: int) -> CostDefaults:
    """Start-up costs from the model's size and measured rates of the project's machines
    (docs/results.md): prefill at ~2 FLOP per parameter per token at about half the bf16
    matmul rate measured on the H200 (738 TFLOP/s), or ~50 GFLOP/s on a 2-core CPU; a
    decode step of 4.5 ms on the H200 (qwen3-8b, batch 1); the Mooncake tcp transport's
    0.5-0.6 GB/s and the ipc transport's tens of GB/s. The fits replace them within
    a few dozen steps and rooms, so they only need to be the right order of magnitude."""
    cuda = device_type == "cuda"
    flops_per_s = 3.7e14 if cuda else 5e10
    s_per_token = 2.0 * num_params / flops_per_s
    if transport == "mooncake":
        bytes_per_s = 0.6e9
    else:
        bytes_per_s = 5e10 if cuda else 2e9
    return CostDefaults(
        local_s_per_token=s_per_token,
        step_s=0.0045 if cuda else 0.01,
        remote_overhead_s=0.005,
        remote_s_per_token=s_per_token,
        transfer_bytes_per_s=bytes_per_s,
    )


class PrefillDemand(NamedTuple):
    """One request's uncached prompt and what this rank is busy with when it asks."""

    num_uncached_tokens: int  # to compute here, or on the prefill rank and transfer
    num_queued_local_tokens: int  # local prefill tokens already waiting on this rank
    num_running_reqs: int  # decodes that a local prefill would slow down
    # The whole prompt: what a prefill rank computes, less what its own cache holds.
    num_prompt_tokens: int = 0


class TtftEstimate(NamedTuple):
    local_ttft_s: float  # this rank's steps until the prompt is computed
    decode_slowdown_s: float  # total delay those steps add to the running decodes
    remote_ttft_s: float  # prefill rank's queue + compute + transfer + round trip

    @property
    def local_cost_s(self) -> float:
        return self.local_ttft_s + self.decode_slowdown_s

    @property
    def prefers_local(self) -> bool:
        return self.local_cost_s <= self.remote_ttft_s


class PathCosts:
    """The decode rank's measured costs. Fed on the engine thread: every step that
    computed prefill tokens (`observe_step`) and every room that completed
    (`observe_room`)."""

    def __init__(
        self,
        defaults: CostDefaults,
        kv_bytes_per_token: int,
        chunk_tokens: int,
        step_tokens: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`chunk_tokens`: prompt tokens a step computes beside running decodes;
        `step_tokens`: a step's whole budget (what it computes when nothing decodes)."""
        self.clock = clock
        self.remote_observed_s = clock()  # when a room last landed (start: the priors)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.chunk_tokens = chunk_tokens
        self.step_tokens = step_tokens
        self.step = LinearFit(defaults.step_s, defaults.local_s_per_token, chunk_tokens)
        # The prefill rank's queue + compute against the tokens it computed.
        self.remote_prefill = LinearFit(0.0, defaults.remote_s_per_token, chunk_tokens)
        # Of a prompt, the fraction the prefill rank computes (the rest its cache holds):
        # a room always computes more than the decode rank's uncached suffix unless the
        # prefill rank holds the prefix too.
        self.remote_computed_fraction = Ewma(1.0)
        self.remote_overhead_s = Ewma(defaults.remote_overhead_s, clip=True)
        self.transfer_bytes_per_s = Ewma(defaults.transfer_bytes_per_s, clip=True)

    def observe_step(self, num_prefill_tokens: int, step_s: float) -> None:
        self.step.observe(num_prefill_tokens, step_s)

    def observe_room(
        self,
        num_prompt_tokens: int,
        num_computed_tokens: int,
        room_s: float,
        prefill_s: float,
        send_s: float,
        kv_bytes: int,
    ) -> None:
        """A room took `room_s` from its task to its result; the prefill rank computed
        `num_computed_tokens` of the prompt and reported `prefill_s` (its queue and
        compute) and `send_s` (the write)."""
        self.remote_observed_s = self.clock()
        self.remote_prefill.observe(num_computed_tokens, prefill_s)
        self.remote_computed_fraction.observe(num_computed_tokens / max(num_prompt_tokens, 1))
        self.remote_overhead_s.observe(max(room_s - prefill_s - send_s, 0.0))
        if kv_bytes >= 1 << 20 and send_s > 0:  # small writes measure latency, not bandwidth
            self.transfer_bytes_per_s.observe(kv_bytes / send_s)

    def remote_weight(self) -> float:
        """How much of what rooms taught beyond the priors still counts (1: a room just
        landed; halves every `_REMOTE_HALF_LIFE_S` without one)."""
        age_s = max(self.clock() - self.remote_observed_s, 0.0)
        return 0.5 ** (age_s / _REMOTE_HALF_LIFE_S)

    def estimate(self, demand: PrefillDemand) -> TtftEstimate:
        weight = self.remote_weight()
        overhead_s = self.remote_overhead_s.faded(weight, worse_if_higher=True)
        bytes_per_s = self.transfer_bytes_per_s.faded(weight, worse_if_higher=False)
        step_s, s_per_token = self.step.coefficients
        num_local_tokens = demand.num_queued_local_tokens + demand.num_uncached_tokens
        tokens_per_step = self.chunk_tokens if demand.num_running_reqs else self.step_tokens
        num_steps = math.ceil(num_local_tokens / tokens_per_step)
        transfer_s = demand.num_uncached_tokens * self.kv_bytes_per_token / bytes_per_s
        num_prompt_tokens = max(demand.num_prompt_tokens, demand.num_uncached_tokens)
        num_remote_tokens = max(
            num_prompt_tokens * self.remote_computed_fraction.value, demand.num_uncached_tokens
        )
        return TtftEstimate(
            local_ttft_s=num_steps * step_s + num_local_tokens * s_per_token,
            decode_slowdown_s=demand.num_running_reqs * demand.num_uncached_tokens * s_per_token,
            remote_ttft_s=(
                overhead_s + self.remote_prefill.predict(num_remote_tokens) + transfer_s
            ),
        )

    def snapshot(self) -> dict[str, float]:
        """The fits in force, for /metrics."""
        step_s, s_per_token = self.step.coefficients
        remote_s, remote_s_per_token = self.remote_prefill.coefficients
        return {
            "pd_cost_local_step_s": step_s,
            "pd_cost_local_s_per_token": s_per_token,
            "pd_cost_remote_prefill_s": remote_s,
            "pd_cost_remote_s_per_token": remote_s_per_token,
            "pd_cost_remote_computed_fraction": self.remote_computed_fraction.value,
            "pd_cost_remote_overhead_s": self.remote_overhead_s.value,
            "pd_cost_transfer_bytes_per_s": self.transfer_bytes_per_s.value,
            "pd_cost_remote_weight": self.remote_weight(),
        }
