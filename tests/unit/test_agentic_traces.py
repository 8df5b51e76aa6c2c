"""The agent trace loaders on small files written in each documented format (Mooncake rows
with and without sessions, Weka/kv-cache-tester conversations with sub-agents in both
nested-time conventions, Dynamo request traces gzipped): sessions, turns, pauses,
sub-agents and shared blocks exactly as the records say."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvstrata.sim.agent_sessions import AgentTurn, Blocks
from kvstrata.sim.agent_trace import AgentTraceError, detect_format, load_agent_trace

MOONCAKE = [
    {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
    {
        "timestamp": 500,
        "session_id": "s1",
        "input_length": 600,
        "output_length": 5,
        "hash_ids": [0, 2],
    },
    {
        "timestamp": 900,
        "session_id": "s1",
        "input_length": 1100,
        "output_length": 5,
        "hash_ids": [0, 2, 3],
        "delay": 250,
    },
    {
        "timestamp": 2000,
        "session_id": "s1",
        "input_length": 1200,
        "output_length": 5,
        "hash_ids": [0, 2, 3],
    },
    {
        "created_time": 1000,
        "input_tokens": 300,
        "output_tokens": 7,
        "hash_ids": [4],
        "session_id": "s2",
        "delay_ms": 0,
    },
]

WEKA_RELATIVE = {
    "id": "conv1",
    "models": ["m"],
    "block_size": 64,
    "tool_tokens": 100,
    "system_tokens": 28,
    "requests": [
        {"t": 0.0, "type": "s", "in": 200, "out": 20, "hash_ids": [1, 2, 3], "api_time": 1.5},
        {"t": 3.0, "type": "s", "in": 260, "out": 10, "hash_ids": [1, 2, 3, 4], "think_time": 0.5},
        {
            "t": 4.0,
            "type": "subagent",
            "agent_id": "ab12",
            "subagent_type": "Explore",
            "requests": [
                {"t": 0.0, "type": "s", "in": 150, "out": 5, "hash_ids": [1, 9], "api_time": 1.0},
                {"t": 2.0, "type": "n", "in": 160, "out": 5, "hash_ids": [1, 9]},
            ],
        },
        {"t": 10.0, "type": "s", "in": 300, "out": 10, "hash_ids": [1, 2, 3, 4]},
    ],
}
WEKA_ABSOLUTE = {
    "id": "conv2",
    "block_size": 64,
    "requests": [
        {"t": 0.0, "type": "s", "in": 100, "out": 5, "hash_ids": [1]},
        {
            "t": 50.0,
            "type": "subagent",
            "agent_id": "x",
            "requests": [
                {"t": 51.0, "type": "s", "in": 70, "out": 3, "hash_ids": [1]},
            ],
        },
    ],
}


def dynamo_row(received_ms: int, total_ms: int, hashes: list[int], **context: str) -> dict:
    request = {
        "request_id": f"r{received_ms}",
        "request_received_ms": received_ms,
        "total_time_ms": total_ms,
        "input_tokens": 64 * len(hashes),
        "output_tokens": 16,
        "replay": {
            "trace_block_size": 64,
            "input_length": 64 * len(hashes),
            "input_sequence_hashes": hashes,
        },
    }
    row = {"schema": "dynamo.request.trace.v1", "event_type": "request_end", "request": request}
    return row | ({"agent_context": context} if context else {})


DYNAMO = [
    dynamo_row(1000, 500, [111, 222], trajectory_id="run:planner"),
    {"schema": "dynamo.request.trace.v1", "event_type": "tool_end", "tool": {"duration_ms": 1}},
    dynamo_row(
        1700,
        300,
        [111, 222, 333],
        trajectory_id="run:researcher",
        parent_trajectory_id="run:planner",
    ),
    dynamo_row(2500, 100, [111, 222, 444, 555], trajectory_id="run:planner"),
    dynamo_row(1200, 50, [999]),
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def test_mooncake_rows_with_and_without_sessions(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "trace.jsonl", MOONCAKE)
    assert detect_format(path) == "mooncake"
    workload = load_agent_trace(path)
    assert workload.block_len == 512
    assert [(s.session_id, s.start_s) for s in workload.sessions] == [
        ("mooncake-0", 0.0),
        ("s1", 0.5),
        ("s2", 1.0),
    ]
    one, s1, s2 = workload.sessions
    assert one.turns == (AgentTurn(Blocks((0, 1), 1000), 10, 0.0),)
    # delay (ms) when given, else the timestamps' difference.
    assert [t.pause_s for t in s1.turns] == [0.0, 0.25, 1.1]
    assert [t.prompt for t in s1.turns] == [
        Blocks((0, 2), 600),
        Blocks((0, 2, 3), 1100),
        Blocks((0, 2, 3), 1200),
    ]
    assert s2.turns == (AgentTurn(Blocks((4,), 300), 7, 0.0),)
    assert all(s.parent is None for s in workload.sessions)


def test_weka_conversations_with_sub_agents_in_both_time_conventions(tmp_path: Path) -> None:
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "a.json").write_text(json.dumps(WEKA_RELATIVE))
    (tmp_path / "traces" / "b.json").write_text(json.dumps(WEKA_ABSOLUTE))
    assert detect_format(tmp_path / "traces") == "weka"
    workload = load_agent_trace(tmp_path / "traces", root_gap_s=5.0)
    assert workload.block_len == 64
    ids = [s.session_id for s in workload.sessions]
    assert ids == ["conv1", "conv1::sa:ab12", "conv2", "conv2::sa:x"]
    conv1, sub1, conv2, sub2 = workload.sessions
    assert (conv1.start_s, conv2.start_s) == (0.0, 5.0)
    # think_time, else the gap after the previous request's api_time (here none: t - t).
    assert [t.pause_s for t in conv1.turns] == [0.0, 0.5, 7.0]
    assert conv1.turns[1].children == (1,) and sub1.parent == 0 and sub1.joins_parent
    # Relative times: spawned at 4.0 by the turn sent at 3.0 (ended 3.0); 2.0 after the
    # first sub-agent request's end (0.0 + 1.0).
    assert [t.pause_s for t in sub1.turns] == [1.0, 1.0]
    # Hash ids are per file: conv1's 1 and conv2's 1 are different blocks.
    assert conv1.turns[0].prompt == Blocks((0, 1, 2), 200)
    assert sub1.turns[0].prompt == Blocks((0, 4), 150)
    assert conv2.turns[0].prompt == Blocks((5,), 100)
    assert sub2.turns[0].prompt == Blocks((5,), 70)  # the parent's block 1, same file
    # Absolute times: spawned at 50.0 after the only parent turn, which never resumes.
    assert sub2.turns[0].pause_s == 51.0 and not sub2.joins_parent


def test_dynamo_request_traces_by_trajectory(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "capture.000000.jsonl.gz", DYNAMO)
    assert detect_format(path) == "dynamo"
    workload = load_agent_trace(path)
    assert workload.block_len == 64
    planner, researcher, solo = workload.sessions
    assert (planner.session_id, researcher.session_id) == ("run:planner", "run:researcher")
    assert solo.session_id == "dynamo-r1200" and solo.start_s == pytest.approx(0.2)
    # Paused from the previous turn's end: 2.5 - (1.0 + 0.5).
    assert [t.pause_s for t in planner.turns] == [0.0, pytest.approx(1.0)]
    assert planner.turns[0].children == (1,) and researcher.parent == 0
    assert researcher.turns[0].pause_s == pytest.approx(0.2) and researcher.joins_parent
    assert [t.prompt for t in planner.turns] == [Blocks((0, 1), 128), Blocks((0, 1, 4, 5), 256)]
    assert researcher.turns[0].prompt == Blocks((0, 1, 3), 192)
    assert solo.turns[0].prompt == Blocks((2,), 64)


def test_malformed_records_name_their_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [MOONCAKE[0], {"timestamp": 1, "hash_ids": []}])
    with pytest.raises(AgentTraceError, match=r"bad.jsonl:2"):
        load_agent_trace(path, "mooncake")
    with pytest.raises(AgentTraceError, match="no such trace"):
        load_agent_trace(tmp_path / "missing.jsonl")
