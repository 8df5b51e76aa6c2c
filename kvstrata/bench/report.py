"""`BenchReport`: the structured result of one benchmark run (latency statistics,
throughput, prompt tokens per tier, per-round, per-rank and, for agent sessions,
per-pause-length figures, every request) built from the runner's results, and its JSON
form (`to_json` / `from_json`)."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstrata.bench.runner import RequestResult
from kvstrata.sim.agent_sessions import PAUSE_BUCKETS, pause_bucket

MAX_ERRORS_KEPT = 10


@dataclass(frozen=True)
class Stats:
    """Summary of a sample in seconds; all 0.0 when it is empty (n == 0)."""

    n: int = 0
    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        if not values:
            return cls()
        a = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = np.percentile(a, [50, 90, 99]).tolist()
        return cls(len(a), float(a.mean()), p50, p90, p99, float(a.max()))


@dataclass(frozen=True)
class TierSummary:
    """Prompt tokens by where they came from. `computed_tokens` were prefilled by the rank
    that answered (prompt - cached - transferred); with PD the decode rank computes none,
    so cached + transferred == prompt. Hit rates are fractions of `prompt_tokens`;
    `cached_tokens` is the server's `prompt_tokens_details.cached_tokens` (every tier)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_l1: int = 0
    cached_tokens_l2: int = 0
    cached_tokens_l3: int = 0
    transferred_tokens: int = 0
    computed_tokens: int = 0
    hit_rate: float = 0.0
    hit_rate_l1: float = 0.0
    hit_rate_l2: float = 0.0
    hit_rate_l3: float = 0.0
    transferred_rate: float = 0.0

    @classmethod
    def of(cls, results: Sequence[RequestResult]) -> TierSummary:
        ok = [r for r in results if r.completion.ok]
        prompt = sum(r.prompt_tokens for r in ok)
        tiers = [r.completion.tiers for r in ok if r.completion.tiers is not None]
        l1, l2, l3 = (sum(getattr(t, f"cached_l{i}") for t in tiers) for i in (1, 2, 3))
        transferred = sum(t.transferred for t in tiers)
        cached = sum(
            r.completion.cached_tokens
            if r.completion.cached_tokens is not None
            else (r.completion.tiers.cached if r.completion.tiers is not None else 0)
            for r in ok
        )
        computed = prompt - cached - transferred if tiers else prompt - cached

        def rate(tokens: int) -> float:
            return tokens / prompt if prompt else 0.0

        return cls(
            prompt,
            cached,
            l1,
            l2,
            l3,
            transferred,
            computed,
            rate(cached),
            rate(l1),
            rate(l2),
            rate(l3),
            rate(transferred),
        )


@dataclass(frozen=True)
class RoundSummary:
    round: int  # 1-based, as printed
    num_requests: int
    mean_prompt_tokens: float
    ttft_s: Stats
    tiers: TierSummary


@dataclass(frozen=True)
class PauseSummary:
    """agentic: the resumed turns (a session's turns after its first) whose pause before
    them, as sent, fell in one bucket (sim/agent_sessions.PAUSE_BUCKETS; "all": every
    resumed turn)."""

    bucket: str
    num_requests: int
    ttft_s: Stats
    tiers: TierSummary


@dataclass(frozen=True)
class RankSummary:
    """One decode rank (or unified rank): what the client saw it serve, and what the
    router says it routed there during the run (None without a router)."""

    rank: int
    num_requests: int
    prompt_tokens: int
    num_routed: int | None = None


@dataclass(frozen=True)
class RequestRecord:
    conversation: int
    group: int
    round: int  # 1-based
    start_s: float
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int | None
    cached_tokens_l1: int | None
    cached_tokens_l2: int | None
    cached_tokens_l3: int | None
    transferred_tokens: int | None
    rank: int | None
    error: str | None
    output_ids: list[int] | None
    session_id: str | None = None  # agentic
    pause_s: float | None = None  # agentic: the pause before a resumed turn


@dataclass(frozen=True)
class BenchReport:
    label: str
    workload: str
    url: str
    backend: str  # "generate" (token ids) or "openai" (text)
    date: str  # ISO 8601, UTC, when the run started
    server: dict[str, Any]
    config: dict[str, Any]
    duration_s: float
    timed_out: bool  # the run hit --max-duration-s
    num_requests: int  # in the workload
    num_sent: int
    num_ok: int
    num_failed: int
    ttft_s: Stats
    tpot_s: Stats
    itl_s: Stats
    e2e_s: Stats
    request_throughput_per_s: float
    input_token_throughput_per_s: float
    output_token_throughput_per_s: float
    tiers: TierSummary
    rounds: list[RoundSummary]
    ranks: list[RankSummary]
    load_imbalance: float  # max / mean requests per rank (1.0: perfectly even)
    token_imbalance: float  # max / mean prompt tokens per rank
    errors: list[str] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)
    pauses: list[PauseSummary] = field(default_factory=list)  # agentic: by pause length

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> BenchReport:
        return _from_dict(cls, body)


def _tpot_s(result: RequestResult) -> float | None:
    c = result.completion
    if not c.ok or c.ttft_s is None or c.num_output_tokens < 2:
        return None
    return (c.e2e_s - c.ttft_s) / (c.num_output_tokens - 1)


def _record(result: RequestResult, keep_ids: bool) -> RequestRecord:
    c, t = result.completion, result.completion.tiers
    return RequestRecord(
        result.conversation,
        result.group,
        result.round + 1,
        result.start_s,
        c.ttft_s,
        _tpot_s(result),
        c.e2e_s,
        result.prompt_tokens,
        c.num_output_tokens,
        c.cached_tokens,
        t.cached_l1 if t else None,
        t.cached_l2 if t else None,
        t.cached_l3 if t else None,
        t.transferred if t else None,
        c.rank,
        c.error,
        list(c.output_ids) if keep_ids and c.ok else None,
        result.session_id,
        result.pause_s,
    )


def _pauses(ok: list[RequestResult]) -> list[PauseSummary]:
    """TTFT and tiers of resumed turns, by pause bucket and all together (empty when no
    request was a resumed agent turn)."""
    resumed = [r for r in ok if r.pause_s is not None]
    if not resumed:
        return []
    groups = [
        (label, [r for r in resumed if pause_bucket(r.pause_s or 0.0) == label])
        for label, _ in PAUSE_BUCKETS
    ]
    groups.append(("all", resumed))
    return [
        PauseSummary(
            label,
            len(group),
            Stats.of([r.completion.ttft_s for r in group if r.completion.ttft_s is not None]),
            TierSummary.of(group),
        )
        for label, group in groups
    ]


def _imbalance(loads: list[int]) -> float:
    """max / mean over the ranks (0.0 when nothing was served)."""
    return max(loads) / float(np.mean(loads)) if loads and sum(loads) else 0.0


def _ranks(ok: list[RequestResult], num_ranks: int, routed: dict[int, int]) -> list[RankSummary]:
    indices = set(range(num_ranks)) | {
        r.completion.rank for r in ok if r.completion.rank is not None
    }
    return [
        RankSummary(
            rank,
            sum(r.completion.rank == rank for r in ok),
            sum(r.prompt_tokens for r in ok if r.completion.rank == rank),
            routed.get(rank),
        )
        for rank in sorted(indices)
    ]


def build_report(
    results: Sequence[RequestResult],
    *,
    label: str,
    workload: str,
    url: str,
    backend: str,
    date: str,
    server: dict[str, Any],
    config: dict[str, Any],
    duration_s: float,
    timed_out: bool,
    num_requests: int,
    num_ranks: int,
    routed: dict[int, int],
    keep_output_ids: bool,
) -> BenchReport:
    """Aggregate the results of one run. Latency statistics use successful requests only."""
    results = sorted(results, key=lambda r: (r.start_s, r.conversation, r.round))
    ok = [r for r in results if r.completion.ok]
    ttfts = [r.completion.ttft_s for r in ok if r.completion.ttft_s is not None]
    tpots = [t for r in ok if (t := _tpot_s(r)) is not None]
    itls = [gap for r in ok for gap in r.completion.itl_s]
    rounds = []
    for index in sorted({r.round for r in ok}):
        in_round = [r for r in ok if r.round == index]
        rounds.append(
            RoundSummary(
                index + 1,
                len(in_round),
                float(np.mean([r.prompt_tokens for r in in_round])),
                Stats.of(
                    [r.completion.ttft_s for r in in_round if r.completion.ttft_s is not None]
                ),
                TierSummary.of(in_round),
            )
        )
    ranks = _ranks(ok, num_ranks, routed)
    errors = list(dict.fromkeys(r.completion.error for r in results if r.completion.error))
    duration = max(duration_s, 1e-9)
    return BenchReport(
        label=label,
        workload=workload,
        url=url,
        backend=backend,
        date=date,
        server=server,
        config=config,
        duration_s=duration_s,
        timed_out=timed_out,
        num_requests=num_requests,
        num_sent=len(results),
        num_ok=len(ok),
        num_failed=len(results) - len(ok),
        ttft_s=Stats.of(ttfts),
        tpot_s=Stats.of(tpots),
        itl_s=Stats.of(itls),
        e2e_s=Stats.of([r.completion.e2e_s for r in ok]),
        request_throughput_per_s=len(ok) / duration,
        input_token_throughput_per_s=sum(r.prompt_tokens for r in ok) / duration,
        output_token_throughput_per_s=sum(r.completion.num_output_tokens for r in ok) / duration,
        tiers=TierSummary.of(ok),
        rounds=rounds,
        ranks=ranks,
        load_imbalance=_imbalance([rank.num_requests for rank in ranks]),
        token_imbalance=_imbalance([rank.prompt_tokens for rank in ranks]),
        errors=errors[:MAX_ERRORS_KEPT],
        requests=[_record(r, keep_output_ids) for r in results],
        pauses=_pauses(ok),
    )


def _from_dict(cls: type, body: dict[str, Any]) -> Any:
    """Rebuild nested frozen dataclasses from `dataclasses.asdict` output; unknown keys
    (from a newer version) are dropped, missing ones take the field default."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in body:
            continue
        tp, value = hints[f.name], body[f.name]
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            value = _from_dict(tp, value)  # type: ignore[arg-type]
        elif typing.get_origin(tp) is list and value is not None:
            (item,) = typing.get_args(tp)
            if dataclasses.is_dataclass(item):
                value = [_from_dict(item, v) for v in value]  # type: ignore[arg-type]
        values[f.name] = value
    return cls(**values)
