"""Public agent traces as an `AgentWorkload`: Mooncake JSONL (with the `session_id` /
`delay` rows Dynamo's and AIPerf's replayers read), Dynamo's request traces
(`dynamo.request.trace.v1`) and the Weka/kv-cache-tester coding-agent traces
(agent_trace_weka.py). docs/agentic-workload.md names every field read and ignored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstrata.sim.agent_drafts import (
    AgentTraceError,
    BlockIds,
    DraftSession,
    DraftTurn,
    attach_children,
    first,
    freeze,
    iter_records,
)
from kvstrata.sim.agent_sessions import AgentWorkload, Blocks
from kvstrata.sim.agent_synth import AgenticOptions, synthesize
from kvstrata.sim.agent_trace_weka import load_weka

MOONCAKE_BLOCK_LEN = 512  # tokens per hash id in the Mooncake FAST'25 traces


def detect_format(path: Path) -> str:
    """mooncake, weka or dynamo, by the first record's keys."""
    record = next(iter_records(path), None)
    if record is None:
        raise AgentTraceError(f"{path}: no records")
    _, body = record
    if body.get("schema", "").startswith("dynamo.request.trace"):
        return "dynamo"
    if "requests" in body:
        return "weka"
    if "hash_ids" in body or "input_length" in body or "input_tokens" in body:
        return "mooncake"
    raise AgentTraceError(f"{path}: not a Mooncake, Dynamo or Weka trace record")


def load_mooncake(path: Path, block_len: int) -> AgentWorkload:
    """Mooncake rows: `timestamp` (ms, alias `created_time`), `input_length` (`input_tokens`),
    `output_length` (`output_tokens`), `hash_ids`. Rows sharing a `session_id` are turns
    of one session in file order, each after the previous by `delay` (ms, alias
    `delay_ms`, plus `tool_wait_ms` when given) or else the timestamps' difference; a row
    without one is a session of one turn. Hash ids are global to the file."""
    block_len = block_len or MOONCAKE_BLOCK_LEN
    blocks = BlockIds()
    sessions: dict[str, DraftSession] = {}
    roots: list[DraftSession] = []
    for where, row in iter_records(path):
        try:
            start_s = float(first(row, "timestamp", "created_time") or 0.0) / 1000
            input_len = int(first(row, "input_length", "input_tokens"))
            output_len = int(first(row, "output_length", "output_tokens") or 0)
            block_ids = blocks("mooncake", list(row.get("hash_ids") or []))
            delay_ms = first(row, "delay", "delay_ms")
            tool_wait_ms = float(row.get("tool_wait_ms") or 0.0)
        except (TypeError, ValueError) as e:
            raise AgentTraceError(f"{where}: not a Mooncake row: {e}") from e
        if input_len < 1 or output_len < 0:
            raise AgentTraceError(f"{where}: input_length must be >= 1, output_length >= 0")
        session_id = row.get("session_id")
        draft = sessions.get(session_id) if session_id is not None else None
        if draft is None:
            draft = DraftSession(str(session_id or f"mooncake-{len(roots)}"), start_s)
            roots.append(draft)
            if session_id is not None:
                sessions[session_id] = draft
            pause_s = 0.0
        elif delay_ms is not None or tool_wait_ms:
            pause_s = (float(delay_ms or 0.0) + tool_wait_ms) / 1000
        else:
            pause_s = max(0.0, start_s - draft.turns[-1].start_s)
        prompt = Blocks(block_ids, input_len)
        draft.turns.append(DraftTurn(prompt, max(1, output_len), pause_s, start_s, start_s))
    return freeze("agentic-mooncake", roots, block_len)


def load_dynamo(path: Path, block_len: int) -> AgentWorkload:
    """`request_end` rows of `dynamo.request.trace.v1` (other event types are skipped): a
    session per `agent_context.trajectory_id` (a sub-agent of `parent_trajectory_id`),
    turns in `request.request_received_ms` order, each paused from the previous one's end
    (received + `total_time_ms`); prompts from `request.replay` (`input_length`,
    `input_sequence_hashes`, `trace_block_size`). A row without agent context is a
    session of one turn."""
    rows: list[tuple[float, str, dict[str, Any]]] = []
    for where, row in iter_records(path):
        if row.get("event_type") == "request_end":
            request = row.get("request") or {}
            try:
                rows.append((float(request["request_received_ms"]) / 1000, where, row))
            except (KeyError, TypeError, ValueError) as e:
                raise AgentTraceError(f"{where}: no request.request_received_ms") from e
    rows.sort(key=lambda r: r[0])
    blocks = BlockIds()
    drafts: dict[str, DraftSession] = {}
    parents: dict[str, str] = {}
    sizes: set[int] = set()
    for start_s, where, row in rows:
        request, context = row["request"], row.get("agent_context") or {}
        replay = request.get("replay") or {}
        try:
            input_len = int(first(replay, "input_length") or request["input_tokens"])
            output_len = max(1, int(request.get("output_tokens") or 0))
            end_s = start_s + float(request.get("total_time_ms") or 0.0) / 1000
            block_ids = blocks("dynamo", list(replay.get("input_sequence_hashes") or []))
        except (KeyError, TypeError, ValueError) as e:
            raise AgentTraceError(f"{where}: not a request_end row: {e}") from e
        if replay.get("trace_block_size"):
            sizes.add(int(replay["trace_block_size"]))
        session_id = context.get("trajectory_id") or f"dynamo-{request.get('request_id', where)}"
        draft = drafts.get(session_id)
        if draft is None:
            draft = drafts[session_id] = DraftSession(session_id, start_s)
            pause_s = 0.0
        else:
            pause_s = max(0.0, start_s - draft.turns[-1].end_s)
        if context.get("parent_trajectory_id"):
            parents[session_id] = context["parent_trajectory_id"]
        prompt = Blocks(block_ids, input_len)
        draft.turns.append(DraftTurn(prompt, output_len, pause_s, start_s, end_s))
    if not block_len and len(sizes) > 1:
        raise AgentTraceError(f"{path}: trace_block_size differs ({sorted(sizes)}): give one")
    block_len = block_len or (sizes.pop() if sizes else 0)
    roots = [d for sid, d in drafts.items() if parents.get(sid) not in drafts]
    by_parent: dict[str, list[tuple[DraftSession, float]]] = {}
    for sid, parent_id in parents.items():
        if parent_id in drafts:
            by_parent.setdefault(parent_id, []).append((drafts[sid], drafts[sid].start_s))
    for parent_id, children in by_parent.items():
        attach_children(drafts[parent_id], children)
    return freeze("agentic-dynamo", roots, block_len)


def load_agent_trace(
    path: str | Path, trace_format: str = "auto", block_len: int = 0, root_gap_s: float = 0.0
) -> AgentWorkload:
    """The trace at `path` (a file or, for Weka traces, a directory). `block_len`: tokens
    per hash id (0: the format's own); `root_gap_s`: Weka traces carry no absolute start,
    so their conversations start this far apart."""
    path = Path(path)
    if not path.exists():
        raise AgentTraceError(f"{path}: no such trace file or directory")
    trace_format = detect_format(path) if trace_format == "auto" else trace_format
    if trace_format == "mooncake":
        workload = load_mooncake(path, block_len)
    elif trace_format == "dynamo":
        workload = load_dynamo(path, block_len)
    elif trace_format == "weka":
        workload = load_weka(path, block_len, root_gap_s)
    else:
        raise AgentTraceError(f"unknown agent trace format {trace_format!r}")
    if not workload.sessions:
        raise AgentTraceError(f"{path}: no requests")
    if workload.block_len < 1:
        raise AgentTraceError(f"{path}: no block size in the trace: give one")
    return workload


def build_agent_workload(options: AgenticOptions, seed: int) -> AgentWorkload:
    """The workload `options` describe: the trace named by --agentic-trace, else the
    synthetic sessions (a pure function of the options and `seed`)."""
    if not options.agentic_trace:
        return synthesize(options, seed)
    rate = options.agentic_session_rate
    return load_agent_trace(
        options.agentic_trace,
        options.agentic_trace_format,
        options.agentic_trace_block_len,
        root_gap_s=1.0 / rate if rate > 0 else 0.0,
    )
