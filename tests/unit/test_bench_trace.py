"""Mooncake trace loading and replay: a handmade 5-line trace gives exactly the expected
token blocks (equal hash ids -> equal blocks, so shared prefixes survive), lengths,
arrival times, caps and scaling; malformed records are refused with their line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.bench.config import BenchConfig
from kvstrata.bench.trace import TraceTokens, block_tokens, load_trace
from kvstrata.bench.workloads import build_workload

BLOCK = 4
VOCAB = 1000
# (timestamp ms, input length, output length, hash ids); blocks of 4 tokens, the last partial.
LINES = [
    (0, 10, 3, [0, 1, 2]),
    (100, 12, 2, [0, 1, 3]),
    (250, 5, 1, [0, 4]),
    (300, 4, 5, [5]),
    (1000, 13, 2, [0, 1, 2, 6]),
]


@pytest.fixture()
def trace_path(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h}
        for t, n, o, h in LINES
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def blocks(*hash_ids: int, block_len: int = BLOCK) -> list[int]:
    return [t for h in hash_ids for t in block_tokens(h, block_len, VOCAB).tolist()]


def test_block_tokens_are_a_fixed_function_of_seed_and_hash_id() -> None:
    # Pinned values: the routing simulator and every bench run must draw the same tokens.
    assert block_tokens(0, 8, VOCAB).tolist() == [850, 636, 511, 269, 307, 40, 75, 16]
    assert block_tokens(1, 8, VOCAB).tolist() == [522, 889, 992, 557, 302, 800, 228, 956]
    assert block_tokens(0, 4, VOCAB).tolist() == [850, 636, 511, 269]
    assert block_tokens(0, 8, VOCAB, seed=1).tolist() != block_tokens(0, 8, VOCAB).tolist()
    assert all(0 <= t < 7 for t in block_tokens(9, 64, 7).tolist())


def test_five_line_trace_yields_the_expected_shared_blocks(trace_path: Path) -> None:
    records = load_trace(trace_path, BLOCK)
    assert [r.hash_ids for r in records] == [tuple(h) for *_, h in LINES]
    tokens = TraceTokens(BLOCK, BLOCK, VOCAB)
    prompts = [tokens.prompt(r) for r in records]
    assert prompts[0] == blocks(0, 1, 2)[:10]
    assert prompts[1] == blocks(0, 1, 3)
    assert prompts[2] == blocks(0, 4)[:5]
    assert prompts[3] == blocks(5)
    assert prompts[4] == blocks(0, 1, 2, 6)[:13]
    # The sharing the hash ids promise, and none they do not.
    assert prompts[1][:8] == prompts[0][:8] and prompts[1][8:10] != prompts[0][8:10]
    assert prompts[4][:10] == prompts[0]
    assert prompts[2][:4] == prompts[0][:4] and prompts[2][4] != prompts[0][4]
    assert prompts[3][:4] != prompts[0][:4]


def test_replay_blocks_shrink_prompts_and_keep_the_sharing(trace_path: Path) -> None:
    records = load_trace(trace_path, BLOCK)
    tokens = TraceTokens(BLOCK, 2, VOCAB)  # 2 tokens per hash id: every length halves
    prompts = [tokens.prompt(r) for r in records]
    assert [len(p) for p in prompts] == [5, 6, 3, 2, 7]  # ceil(n * 2 / 4)
    assert prompts[0] == blocks(0, 1, 2, block_len=2)[:5]
    assert prompts[4][:5] == prompts[0]
    assert prompts[1][:4] == prompts[0][:4] and prompts[1][4:6] == blocks(3, block_len=2)
    # A cut keeps the prefix.
    assert tokens.prompt(records[4], max_len=3) == prompts[4][:3]


def test_trace_workload_times_caps_and_skip(trace_path: Path) -> None:
    config = BenchConfig(
        workload="trace",
        trace=str(trace_path),
        trace_block_size=BLOCK,
        trace_speed=2.0,
        max_input_len=11,
        max_output_len=2,
    )
    workload = build_workload(config, VOCAB, max_seq_len=None)
    assert [c.arrival_s for c in workload.conversations] == [0.0, 0.05, 0.125, 0.15, 0.5]
    turns = [c.turns[0] for c in workload.conversations]
    assert [t.new_len for t in turns] == [10, 11, 5, 4, 11]
    assert [t.max_tokens for t in turns] == [2, 2, 1, 2, 2]
    assert turns[4].make_tokens() == blocks(0, 1, 2, 6)[:11]
    # The server's context caps too: prompt + output < max_seq_len.
    fitted = build_workload(
        BenchConfig(workload="trace", trace=str(trace_path), trace_block_size=BLOCK),
        VOCAB,
        max_seq_len=9,
    )
    assert all(t.new_len + t.max_tokens < 9 for c in fitted.conversations for t in c.turns)
    skipped = BenchConfig(
        workload="trace",
        trace=str(trace_path),
        trace_block_size=BLOCK,
        trace_skip=1,
        max_requests=2,
    )
    kept = build_workload(skipped, VOCAB, max_seq_len=None).conversations
    assert [c.arrival_s for c in kept] == [0.0, 0.15]  # relative to the first kept record
    assert kept[0].turns[0].make_tokens() == blocks(0, 1, 3)


def test_malformed_records_name_their_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [0]})
    path.write_text(good + "\n" + '{"timestamp": 1, "input_length": 4}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_trace(path, BLOCK)
    # 9 tokens cannot sit in 2 blocks of 4.
    path.write_text(
        json.dumps({"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [0, 1]})
        + "\n"
    )
    with pytest.raises(ValueError, match="does not fit 2 blocks"):
        load_trace(path, BLOCK)
