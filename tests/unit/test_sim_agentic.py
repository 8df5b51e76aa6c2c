"""`kvstrata simulate --workload agentic` on tiny configurations, exactly: a paused session
whose pages another session's turn pushes out of L1 resumes from L2 under the session
policy (its pages were demoted) and recomputes them under LRU; the run is deterministic;
the CLI sizes L1 from the infinite run and writes the comparison as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from kvstrata.__main__ import main
from kvstrata.sim.agent_report import compare_policies
from kvstrata.sim.agent_run import AgentSim, RunSpec, TurnRecord
from kvstrata.sim.agent_sessions import AgentSession, AgentTurn, AgentWorkload, Appended
from kvstrata.sim.cache import CachePolicy
from kvstrata.sim.config import SimConfig

PAGE = 2


def config(**options: object) -> SimConfig:
    fields = dict(
        workload="agentic",
        page_size=PAGE,
        block_size=4,
        num_decode=1,
        prefill_tokens_per_s=1000.0,
        l2_tokens_per_s=1e6,
        decode_s_per_token=0.001,
    )
    return SimConfig(**(fields | options))  # type: ignore[arg-type]


def two_sessions() -> AgentWorkload:
    """A (from 0 s) pauses 100 s after its first turn; B (from 1 s) runs two turns in
    that pause. Both start with the kind's 4-token prefix P.

    A0: P + 4 -> 8 tokens, answer 2 (A's context: 5 pages). B0: P + 8 -> 12, answer 2
    (7 pages). B1: 14 + 2 -> 16, answer 2 (9 pages): with 10 L1 pages it evicts 2 pages,
    the tail of A's (the one unlocked leaf). A1: 10 + 2 -> 12 tokens."""
    a = AgentSession(0, "a", 0, (AgentTurn(Appended(4), 2, 0.0), AgentTurn(Appended(2), 2, 100.0)))
    b = AgentSession(
        1, "b", 0, (AgentTurn(Appended(8), 2, 0.0), AgentTurn(Appended(2), 2, 1.0)), None, 1.0
    )
    workload = AgentWorkload("agentic", (a, b), prefix_lens=(4,))
    workload.check()
    return workload


def run(policy: CachePolicy, num_l1_pages: int = 10) -> list[TurnRecord]:
    cfg = config()
    spec = RunSpec("run", policy, num_l1_pages, num_l2_pages=10)
    return AgentSim(cfg, two_sessions(), spec).run().turns


def resumed_a(turns: list[TurnRecord]) -> TurnRecord:
    (record,) = [r for r in turns if r.session == 0 and r.turn == 1]
    return record


def test_a_paused_session_resumes_from_l2_under_sessions_and_recomputes_under_lru() -> None:
    sessions = CachePolicy("priority", "write_through_selective", config().session_options)
    lru = CachePolicy("lru", "write_through_selective", None)
    with_sessions, with_lru = resumed_a(run(sessions)), resumed_a(run(lru))
    # Both keep P and A's first private page in L1 (6 tokens) and lost A's last 2 pages
    # from L1; the session table had demoted them to L2, LRU dropped them.
    assert (with_sessions.l1_len, with_sessions.l2_len, with_sessions.computed_len) == (6, 4, 2)
    assert (with_lru.l1_len, with_lru.l2_len, with_lru.computed_len) == (6, 0, 6)
    assert (with_sessions.recomputed_len, with_lru.recomputed_len) == (0, 4)
    assert with_sessions.idle_s == with_lru.idle_s == pytest.approx(100.0)
    assert with_sessions.wait_s == with_lru.wait_s == 0.0  # the lane was free, L1 had room
    # TTFT: computed tokens at 1000/s plus L2 tokens at 1e6/s (the lane is idle).
    assert with_sessions.ttft_s == pytest.approx(0.002 + 4e-6)
    assert with_lru.ttft_s == pytest.approx(0.006)


def test_b_hits_the_shared_prefix_and_its_own_context() -> None:
    turns = run(CachePolicy())
    by_turn = {(r.session, r.turn): r for r in turns}
    assert (by_turn[1, 0].l1_len, by_turn[1, 0].computed_len) == (4, 8)
    assert (by_turn[1, 1].l1_len, by_turn[1, 1].computed_len) == (14, 2)
    assert by_turn[1, 1].idle_s == pytest.approx(1.0)
    assert by_turn[0, 0].idle_s is None and by_turn[1, 0].idle_s is None


def small_synthetic(**options: object) -> SimConfig:
    fields = dict(
        agentic_num_sessions=6,
        agentic_turns=4.0,
        agentic_child_turns=2.0,
        agentic_prefix_len=64,
        agentic_tool_result_len=16,
        agentic_tool_result_p99_len=64,
        agentic_output_len=8,
        agentic_spawn_prob=0.3,
        agentic_max_fanout=4,
        l2_ratio=2.0,
    )
    return config(**(fields | options))


def test_the_comparison_is_deterministic_and_sizes_l1_from_the_infinite_run() -> None:
    first = compare_policies(small_synthetic())
    second = compare_policies(small_synthetic())

    def without_wall(results: tuple) -> list[dict]:
        return [{k: v for k, v in asdict(r).items() if k != "wall_s"} for r in results]

    assert without_wall(first.results) == without_wall(second.results)
    infinite, lru, session = first.results
    assert [r.name for r in first.results] == ["infinite", "lru", "session"]
    assert infinite.recomputed_tokens == 0 and infinite.num_turns == first.num_requests
    # L1 holds a quarter of the live sessions' pages (or the longest request).
    assert lru.l1_tokens_per_rank == session.l1_tokens_per_rank < infinite.l1_tokens_per_rank
    assert lru.l2_tokens_per_rank == 2 * lru.l1_tokens_per_rank
    assert infinite.served_tokens >= max(lru.served_tokens, session.served_tokens)
    assert first.served_vs_infinite("infinite") == 1.0


def test_the_cli_prints_the_comparison_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "agentic.json"
    argv = ["simulate", "--workload", "agentic", "--page-size", "2", "--block-size", "4"]
    argv += ["--agentic-num-sessions", "4", "--agentic-prefix-len", "32"]
    argv += ["--agentic-tool-result-len", "8", "--agentic-tool-result-p99-len", "32"]
    argv += ["--agentic-output-len", "4", "--agentic-turns", "3", "--json-out", str(out)]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "TTFT of resumed turns by pause length" in printed and "target served" in printed
    body = json.loads(out.read_text())
    assert [r["name"] for r in body["comparison"]["results"]] == ["infinite", "lru", "session"]
    assert {b["bucket"] for b in body["comparison"]["results"][0]["buckets"]} >= {"<1 s"}
