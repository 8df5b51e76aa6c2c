"""Building an `AgentWorkload` from a trace: draft sessions a loader fills in record by
record, compact block ids, sub-agents hung on the parent turn that spawned them, and the
records of a JSON, JSONL or gzipped JSONL file (or a directory of JSON files)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.sim.agent_sessions import AgentSession, AgentTurn, AgentWorkload, Blocks


class AgentTraceError(ValueError):
    """A trace that cannot be read; the message names the file and the record."""


@dataclass
class DraftTurn:
    prompt: Blocks
    output_len: int
    pause_s: float
    start_s: float  # when the trace says it was sent, for matching sub-agents to turns
    end_s: float  # when its answer ended, as far as the trace says (else start_s)
    children: list[DraftSession] = field(default_factory=list)


@dataclass
class DraftSession:
    """A session while a loader builds it (mutable; `freeze` makes the workload)."""

    session_id: str
    start_s: float = 0.0
    turns: list[DraftTurn] = field(default_factory=list)
    joins_parent: bool = True


class BlockIds:
    """Compact block ids: each distinct key (a trace's hash id in its scope) gets the next
    integer, so equal keys are equal blocks and ids stay small."""

    def __init__(self) -> None:
        self._ids: dict[tuple[Any, ...], int] = {}

    def __call__(self, scope: Any, hash_ids: list[Any]) -> tuple[int, ...]:
        return tuple(self._ids.setdefault((scope, h), len(self._ids)) for h in hash_ids)


def attach_children(parent: DraftSession, children: list[tuple[DraftSession, float]]) -> int:
    """Hang each (child, spawn time) on the last turn of `parent` sent at or before it;
    the child waits from that turn's end, and the parent waits for it when a later turn
    of the parent starts after the child's last turn ended. Returns how many had no such
    turn (dropped, as AIPerf drops them)."""
    num_dropped = 0
    for child, spawn_s in children:
        before = [t for t in parent.turns if t.start_s <= spawn_s]
        if not before or not child.turns:
            num_dropped += 1
            continue
        spawner = before[-1]
        spawner.children.append(child)
        child.turns[0].pause_s = max(0.0, child.turns[0].start_s - spawner.end_s)
        child_end_s = child.turns[-1].end_s
        child.joins_parent = any(t.start_s >= child_end_s for t in parent.turns)
    return num_dropped


def freeze(name: str, roots: list[DraftSession], block_len: int) -> AgentWorkload:
    """The workload of `roots` (in start order), each followed by its sub-agents in
    depth-first order; start times shifted so the first root starts at 0."""
    roots = sorted(roots, key=lambda s: s.start_s)
    first_s = roots[0].start_s if roots else 0.0
    order: list[tuple[DraftSession, int | None]] = []

    def visit(draft: DraftSession, parent: int | None) -> None:
        index = len(order)
        order.append((draft, parent))
        for turn in draft.turns:
            for child in turn.children:
                visit(child, index)

    for root in roots:
        visit(root, None)
    index_of = {id(draft): i for i, (draft, _) in enumerate(order)}
    sessions = []
    for index, (draft, parent) in enumerate(order):
        turns = tuple(
            AgentTurn(t.prompt, t.output_len, t.pause_s, tuple(index_of[id(c)] for c in t.children))
            for t in draft.turns
        )
        start_s = draft.start_s - first_s if parent is None else 0.0
        sessions.append(
            AgentSession(index, draft.session_id, 0, turns, parent, start_s, draft.joins_parent)
        )
    workload = AgentWorkload(name, tuple(sessions), block_len=block_len)
    workload.check()
    return workload


def iter_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) of every JSON object: a .json file is one record (a directory, one
    per .json file in name order); .jsonl / .jsonl.gz, one per non-empty line."""
    files = sorted(p for p in path.iterdir() if p.suffix == ".json") if path.is_dir() else [path]
    for file in files:
        if file.suffix == ".json":
            yield str(file), _object(json.loads(file.read_text()), str(file))
            continue
        opener = gzip.open if file.suffix == ".gz" else open
        with opener(file, "rt") as lines:
            for line_no, line in enumerate(lines, 1):
                if line.strip():
                    where = f"{file}:{line_no}"
                    try:
                        yield where, _object(json.loads(line), where)
                    except json.JSONDecodeError as e:
                        raise AgentTraceError(f"{where}: not JSON: {e}") from e


def _object(body: Any, where: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise AgentTraceError(f"{where}: a record must be a JSON object")
    return body


def first(body: dict[str, Any], *names: str) -> Any:
    return next((body[n] for n in names if body.get(n) is not None), None)
