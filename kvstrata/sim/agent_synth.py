"""`AgenticOptions`, the `--agentic-*` flags `kvstrata bench` and `kvstrata simulate` share,
and the synthetic agentic workload they describe: sessions of tool-calling turns over a
per-kind system/tool prefix, heavy-tailed pauses and sub-agent fan-out, each a lognormal
fitted to two published quantiles (docs/agentic-workload.md names the sources)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from kvstrata.config import ConfigError, flag, opt
from kvstrata.sim.agent_sessions import AgentSession, AgentTurn, AgentWorkload, Appended

AGENT_TRACE_FORMATS = ("auto", "mooncake", "weka", "dynamo")


@dataclass(frozen=True)
class Lognormal:
    """A lognormal distribution by the mean and deviation of its log."""

    mu: float
    sigma: float

    @classmethod
    def fit(cls, median: float, quantile: float, probability: float) -> Lognormal:
        """The lognormal with this median whose `probability` quantile is `quantile`."""
        if not 0 < median <= quantile or not 0.5 < probability < 1:
            raise ValueError("need 0 < median <= quantile and 0.5 < probability < 1")
        z = NormalDist().inv_cdf(probability)
        return cls(math.log(median), (math.log(quantile) - math.log(median)) / z)

    def quantile(self, probability: float) -> float:
        return math.exp(self.mu + self.sigma * NormalDist().inv_cdf(probability))

    @property
    def mean(self) -> float:
        return math.exp(self.mu + self.sigma**2 / 2)

    def draw(self, rng: np.random.Generator) -> float:
        return float(rng.lognormal(self.mu, self.sigma))


@dataclass(frozen=True)
class AgenticOptions:
    """The shape of the agentic workload (`--workload agentic`). Defaults: the published
    figures in docs/agentic-workload.md; the rest are stated assumptions there."""

    agentic_num_sessions: int = opt(64, "agentic: root agent sessions.")
    agentic_session_rate: float = opt(
        0.5, "agentic: root sessions started per second, Poisson (0: all at once)."
    )
    agentic_num_kinds: int = opt(
        4, "agentic: agent kinds; the sessions of one kind share its system/tool prefix."
    )
    agentic_prefix_len: int = opt(
        16000, "agentic: tokens of each kind's system prompt and tool schemas."
    )
    agentic_turns: float = opt(20.0, "agentic: mean turns of a root session (geometric).")
    agentic_child_turns: float = opt(4.0, "agentic: mean turns of a sub-agent (geometric).")
    agentic_tool_result_len: int = opt(
        400, "agentic: median tokens a turn appends (tool result; lognormal)."
    )
    agentic_tool_result_p99_len: int = opt(8000, "agentic: p99 of the tokens a turn appends.")
    agentic_output_len: int = opt(150, "agentic: tokens of every answer.")
    agentic_pause_median_s: float = opt(
        2.0, "agentic: median pause between a session's turns (lognormal)."
    )
    agentic_pause_p99_s: float = opt(660.0, "agentic: p99 pause between a session's turns.")
    agentic_spawn_prob: float = opt(
        0.05, "agentic: chance that a root session's turn spawns sub-agents."
    )
    agentic_fanout_median: float = opt(7.0, "agentic: median sub-agents a spawn starts.")
    agentic_fanout_p90: float = opt(51.0, "agentic: p90 of the sub-agents a spawn starts.")
    agentic_max_fanout: int = opt(64, "agentic: at most this many sub-agents per spawn.")
    agentic_time_scale: float = opt(
        1.0,
        "agentic: every pause and session start time is divided by this (60: an hour of "
        "agent time in a minute).",
    )
    agentic_trace: str = opt(
        "", "agentic: replay this public agent trace instead of the synthetic sessions."
    )
    agentic_trace_format: str = opt(
        "auto", "agentic: the trace's format (docs/agentic-workload.md).", AGENT_TRACE_FORMATS
    )
    agentic_trace_block_len: int = opt(
        0, "agentic: tokens per trace hash id (0: the format's own, Mooncake's 512)."
    )

    def check_agentic(self) -> None:
        """ConfigError naming the first bad `--agentic-*` flag."""
        at_least_one = (
            "agentic_num_sessions",
            "agentic_num_kinds",
            "agentic_tool_result_len",
            "agentic_output_len",
            "agentic_max_fanout",
            "agentic_turns",
            "agentic_child_turns",
        )
        for name in at_least_one:
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag(name)} must be >= 1")
        if self.agentic_prefix_len < 0 or self.agentic_session_rate < 0:
            raise ConfigError("--agentic-prefix-len and --agentic-session-rate must be >= 0")
        if self.agentic_trace_block_len < 0:
            raise ConfigError("--agentic-trace-block-len must be >= 0")
        if not 0 <= self.agentic_spawn_prob <= 1:
            raise ConfigError("--agentic-spawn-prob must be in [0, 1]")
        if self.agentic_time_scale <= 0:
            raise ConfigError("--agentic-time-scale must be > 0")
        pairs = (
            ("agentic_pause_median_s", "agentic_pause_p99_s"),
            ("agentic_fanout_median", "agentic_fanout_p90"),
            ("agentic_tool_result_len", "agentic_tool_result_p99_len"),
        )
        for low, high in pairs:
            if not 0 < getattr(self, low) <= getattr(self, high):
                raise ConfigError(f"need 0 < {flag(low)} <= {flag(high)}")
        if self.agentic_trace_format not in AGENT_TRACE_FORMATS:
            raise ConfigError(f"--agentic-trace-format: one of {', '.join(AGENT_TRACE_FORMATS)}")

    @property
    def pause_s(self) -> Lognormal:
        return Lognormal.fit(self.agentic_pause_median_s, self.agentic_pause_p99_s, 0.99)

    @property
    def fanout(self) -> Lognormal:
        return Lognormal.fit(self.agentic_fanout_median, self.agentic_fanout_p90, 0.90)

    @property
    def tool_result_len(self) -> Lognormal:
        return Lognormal.fit(self.agentic_tool_result_len, self.agentic_tool_result_p99_len, 0.99)


def synthesize(options: AgenticOptions, seed: int) -> AgentWorkload:
    """The synthetic sessions of `options`, a pure function of (options, seed). Roots in
    start order; each root's sub-agents follow it. A root's turn spawns sub-agents with
    --agentic-spawn-prob (never its last turn, so the parent resumes after they return);
    sub-agents spawn none (Claude Code's do not nest)."""
    rng = np.random.default_rng([seed, 34])
    sessions: list[AgentSession] = []
    start_s = 0.0
    for root_number in range(options.agentic_num_sessions):
        if root_number and options.agentic_session_rate > 0:
            start_s += float(rng.exponential(1.0 / options.agentic_session_rate))
        kind = int(rng.integers(options.agentic_num_kinds))
        _add_root(options, rng, sessions, kind, start_s, seed)
    workload = AgentWorkload(
        "agentic",
        tuple(sessions),
        prefix_lens=(options.agentic_prefix_len,) * options.agentic_num_kinds,
    )
    workload.check()
    return workload


def _add_root(
    options: AgenticOptions,
    rng: np.random.Generator,
    sessions: list[AgentSession],
    kind: int,
    start_s: float,
    seed: int,
) -> None:
    """Append a root session and, after it, the sub-agents its turns spawn."""
    index = len(sessions)
    num_turns = int(rng.geometric(1.0 / options.agentic_turns))
    sessions.append(AgentSession(index, "", kind, ()))  # a placeholder, filled below
    turns: list[AgentTurn] = []
    for turn_index in range(num_turns):
        children: tuple[int, ...] = ()
        is_last = turn_index == num_turns - 1
        if not is_last and rng.random() < options.agentic_spawn_prob:
            num_children = min(options.agentic_max_fanout, max(1, round(options.fanout.draw(rng))))
            children = tuple(
                _add_child(options, rng, sessions, index, kind, seed) for _ in range(num_children)
            )
        pause_s = options.pause_s.draw(rng) if turn_index else 0.0
        turns.append(
            AgentTurn(_appended(options, rng), options.agentic_output_len, pause_s, children)
        )
    sessions[index] = AgentSession(
        index, f"agent-{seed}-{index}", kind, tuple(turns), None, start_s
    )


def _add_child(
    options: AgenticOptions,
    rng: np.random.Generator,
    sessions: list[AgentSession],
    parent: int,
    kind: int,
    seed: int,
) -> int:
    index = len(sessions)
    num_turns = int(rng.geometric(1.0 / options.agentic_child_turns))
    turns = tuple(
        AgentTurn(
            _appended(options, rng),
            options.agentic_output_len,
            options.pause_s.draw(rng) if turn_index else 0.0,  # the task is sent at once
        )
        for turn_index in range(num_turns)
    )
    sessions.append(AgentSession(index, f"agent-{seed}-{index}", kind, turns, parent))
    return index


def _appended(options: AgenticOptions, rng: np.random.Generator) -> Appended:
    return Appended(max(1, round(options.tool_result_len.draw(rng))))
