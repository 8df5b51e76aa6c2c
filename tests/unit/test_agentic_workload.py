"""The synthetic agentic workload and the bench's session runner, against a fake backend:
the pause and fan-out distributions hit their published quantiles for a fixed seed,
sub-agents' prompts start with their parent's whole context, every request names its
session (and the last turn says it is final), pauses are divided by the time scale, and
sessions are cut to the server's context."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import pytest

from kvstrata.bench.agentic import (
    FINAL_HEADER,
    PARENT_HEADER,
    SESSION_HEADER,
    AgentPacing,
    AgentPrompts,
    AgentTokens,
    fit_to_context,
    run_agentic,
)
from kvstrata.bench.client import Completion
from kvstrata.bench.config import BenchConfig
from kvstrata.config import ConfigError
from kvstrata.sim.agent_sessions import (
    AgentSession,
    AgentTurn,
    AgentWorkload,
    Appended,
    pause_bucket,
)
from kvstrata.sim.agent_synth import AgenticOptions, Lognormal, synthesize

VOCAB = 1000
ANSWER = [7, 8, 9]


def test_lognormal_fits_the_published_quantiles() -> None:
    pause = Lognormal.fit(2.0, 660.0, 0.99)
    assert pause.mu == pytest.approx(np.log(2.0))
    assert pause.sigma == pytest.approx(2.4928, abs=1e-4)  # ln(330) / z(0.99)
    assert pause.quantile(0.5) == pytest.approx(2.0)
    assert pause.quantile(0.99) == pytest.approx(660.0)
    fanout = Lognormal.fit(7.0, 51.0, 0.90)
    assert fanout.quantile(0.9) == pytest.approx(51.0)


def test_synthetic_pauses_and_fanout_match_their_quantiles_for_a_fixed_seed() -> None:
    workload = synthesize(AgenticOptions(agentic_num_sessions=400), seed=3)
    pauses = [t.pause_s for s in workload.sessions for t in s.turns[1:]]
    assert len(pauses) > 5000
    assert np.median(pauses) == pytest.approx(2.0, rel=0.1)
    assert np.percentile(pauses, 99) == pytest.approx(660.0, rel=0.3)
    fanouts = [len(t.children) for s in workload.roots for t in s.turns if t.children]
    assert len(fanouts) > 200
    assert np.median(fanouts) == pytest.approx(7, abs=1.5)
    assert np.percentile(fanouts, 90) == pytest.approx(51, rel=0.3)
    assert max(fanouts) <= 64  # --agentic-max-fanout
    # The same seed builds the same workload; sub-agents follow their parent, spawn none,
    # and no session's last turn spawns (the parent resumes after its sub-agents).
    assert synthesize(AgenticOptions(agentic_num_sessions=400), seed=3) == workload
    for session in workload.sessions:
        assert not session.turns[-1].children
        if session.parent is not None:
            assert session.parent < session.index
            assert not any(t.children for t in session.turns)


def test_the_fanout_flag_clips_each_spawn() -> None:
    options = AgenticOptions(agentic_num_sessions=50, agentic_spawn_prob=1.0, agentic_max_fanout=3)
    fanouts = [len(t.children) for s in synthesize(options, 0).roots for t in s.turns[:-1]]
    assert fanouts and max(fanouts) == 3 and min(fanouts) >= 1


def test_bad_agentic_flags_are_refused_naming_them() -> None:
    with pytest.raises(ConfigError, match="--agentic-pause-median-s"):
        BenchConfig(agentic_pause_median_s=700.0)
    with pytest.raises(ConfigError, match="--agentic-time-scale"):
        BenchConfig(agentic_time_scale=0.0)
    with pytest.raises(ConfigError, match="--max-requests"):
        BenchConfig(workload="agentic", max_requests=10)


def test_pause_buckets() -> None:
    labels = [pause_bucket(s) for s in (0.5, 1.0, 59.9, 60.0, 601.0)]
    assert labels == ["<1 s", "1-10 s", "10-60 s", "1-10 min", ">10 min"]


class RecordingBackend:
    """Answers every prompt with ANSWER; records each request's prompt and headers."""

    def __init__(self) -> None:
        self.sent: list[tuple[list[int], dict[str, str]]] = []

    async def send(
        self, prompt: list[int] | str, max_tokens: int, headers: Mapping[str, str] | None = None
    ) -> Completion:
        assert isinstance(prompt, list)
        self.sent.append((prompt, dict(headers or {})))
        await asyncio.sleep(0)
        return Completion(True, None, 0.001, 0.002, (), tuple(ANSWER), "", 3, None, None, None, 0)


def tiny_workload() -> AgentWorkload:
    """A root of three turns whose second spawns two sub-agents (one of two turns)."""
    root = AgentSession(
        0,
        "root",
        0,
        (
            AgentTurn(Appended(5), 3, 0.0),
            AgentTurn(Appended(4), 3, 2.0, children=(1, 2)),
            AgentTurn(Appended(6), 3, 8.0),
        ),
    )
    child_a = AgentSession(
        1, "root.a", 0, (AgentTurn(Appended(2), 3, 0.5), AgentTurn(Appended(2), 3, 1.0)), 0
    )
    child_b = AgentSession(2, "root.b", 0, (AgentTurn(Appended(3), 3, 0.25),), 0)
    workload = AgentWorkload("agentic", (root, child_a, child_b), prefix_lens=(10,))
    workload.check()
    return workload


def run(workload: AgentWorkload, time_scale: float = 1000.0) -> RecordingBackend:
    backend = RecordingBackend()
    prompts = AgentPrompts(AgentTokens(workload, VOCAB, seed=1), None)
    pacing = AgentPacing(max_concurrency=0, time_scale=time_scale, max_duration_s=60.0)
    outcome = asyncio.run(run_agentic(workload, backend, prompts, pacing))  # type: ignore[arg-type]
    assert not outcome.timed_out and len(outcome.results) == workload.num_requests
    return backend


def test_sub_agents_start_with_the_parents_context_and_headers_name_sessions() -> None:
    backend = run(tiny_workload())
    by_session: dict[str, list[tuple[list[int], dict[str, str]]]] = {}
    for prompt, headers in backend.sent:
        by_session.setdefault(headers[SESSION_HEADER], []).append((prompt, headers))
    root, child_a, child_b = by_session["root"], by_session["root.a"], by_session["root.b"]
    assert [len(p) for p, _ in root] == [10 + 5, 15 + 3 + 4, 22 + 3 + 6]
    spawned_from = root[1][0] + ANSWER  # the spawning turn's prompt and its answer
    for child in (child_a, child_b):
        assert child[0][0][: len(spawned_from)] == spawned_from
        assert all(h[PARENT_HEADER] == "root" for _, h in child)
    # Each turn extends the session's previous prompt by its answer and new tokens.
    assert root[1][0][:15] == root[0][0] and root[2][0][:25] == root[1][0] + ANSWER
    # Only a session's last turn is final; a root names no parent.
    assert [FINAL_HEADER in h for _, h in root] == [False, False, True]
    assert [FINAL_HEADER in h for _, h in child_a] == [False, True]
    assert child_b[0][1][FINAL_HEADER] == "true"
    assert all(PARENT_HEADER not in h for _, h in root)
    # The root's last turn waited for both sub-agents.
    order = [h[SESSION_HEADER] for _, h in backend.sent]
    assert order.index("root", 2) > max(i for i, s in enumerate(order) if s != "root")


def test_pauses_are_divided_by_the_time_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay_s: float) -> None:
        slept.append(delay_s)
        await real_sleep(0)

    monkeypatch.setattr("kvstrata.bench.agentic.asyncio.sleep", sleep)
    run(tiny_workload(), time_scale=4.0)
    # Pauses of every turn but the roots' first: 2, 8 (root), 0.5, 1 (a), 0.25 (b).
    pauses = sorted(d for d in slept if d > 0)
    assert pauses == pytest.approx(sorted(p / 4.0 for p in (2.0, 8.0, 0.5, 1.0, 0.25)))


def test_sessions_are_cut_to_the_context_with_their_sub_agents() -> None:
    workload = tiny_workload()
    # Root prompts (and answers): 15 (+3), 22 (+3), 31 (+3); a: 27, 32; b: 28.
    fitted, num_cut = fit_to_context(workload, 32)
    assert num_cut == 2  # the root's last turn and a's second
    assert [len(s.turns) for s in fitted.sessions] == [2, 1, 1]
    fitted, num_cut = fit_to_context(workload, 25)  # the spawning turn goes, and a and b
    assert num_cut == 5 and [s.session_id for s in fitted.sessions] == ["root"]
    assert fitted.sessions[0].turns == (replace(workload.sessions[0].turns[0]),)
