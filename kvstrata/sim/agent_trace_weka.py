"""The Weka / kv-cache-tester coding-agent traces (github.com/callanjfox/kv-cache-tester,
published on Hugging Face as semianalysisai/cc-traces-weka-*) as an `AgentWorkload`: one
JSON object per conversation, its requests and its nested sub-agents (`type: subagent`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstrata.sim.agent_drafts import (
    AgentTraceError,
    BlockIds,
    DraftSession,
    DraftTurn,
    attach_children,
    freeze,
    iter_records,
)
from kvstrata.sim.agent_sessions import AgentWorkload, Blocks


def load_weka(path: Path, block_len: int, root_gap_s: float) -> AgentWorkload:
    """Each conversation (`id`, `block_size`, `requests`) is a root session; its requests
    of `type` n or s are its turns (`t` seconds, `in`, `out`, `hash_ids`, and for the pause
    `think_time`, else the gap after the previous request's `api_time`, else the gap
    between `t`s); each `type: subagent` entry is a sub-agent session spawned by the last
    turn before its `t`. Hash ids are local to a file unless `hash_id_scope` says
    otherwise. Conversations carry no absolute start: they start `root_gap_s` apart."""
    blocks = BlockIds()
    roots: list[DraftSession] = []
    sizes: set[int] = set()
    for number, (where, body) in enumerate(iter_records(path)):
        try:
            trace_id = str(body.get("id") or f"weka-{number}")
            requests = list(body["requests"])
            if body.get("block_size"):
                sizes.add(int(body["block_size"]))
            scope = number if body.get("hash_id_scope", "local") == "local" else "global"
            relative = _nested_times_are_relative(requests)
            reader = _Reader(blocks, scope, relative, where)
            root = reader.session(trace_id, requests, 0.0)
            if not root.turns:
                raise ValueError("no requests of type n or s")
        except (KeyError, TypeError, ValueError) as e:
            raise AgentTraceError(f"{where}: not a Weka trace: {e}") from e
        root.start_s = len(roots) * root_gap_s
        roots.append(root)
    if not block_len and len(sizes) > 1:
        raise AgentTraceError(f"{path}: block_size differs between traces ({sorted(sizes)})")
    return freeze("agentic-weka", roots, block_len or (sizes.pop() if sizes else 0))


def _nested_times_are_relative(requests: list[dict[str, Any]]) -> bool:
    """kv-cache-tester writes a sub-agent's request times from its spawn (its first is
    0.0), the published AgentX traces from the conversation's start: relative when any
    sub-agent's first request is earlier than its own spawn."""
    for entry in requests:
        inner = entry.get("requests") or []
        if entry.get("type") == "subagent" and inner and float(inner[0]["t"]) < float(entry["t"]):
            return True
    return False


class _Reader:
    """Reads the requests of one file into draft sessions (one hash-id scope)."""

    def __init__(self, blocks: BlockIds, scope: Any, relative: bool, where: str) -> None:
        self.blocks = blocks
        self.scope = scope
        self.relative = relative
        self.where = where

    def session(
        self, session_id: str, requests: list[dict[str, Any]], base_s: float
    ) -> DraftSession:
        """`requests` as a session whose times are `t` + `base_s` (seconds)."""
        draft = DraftSession(session_id, base_s)
        children: list[tuple[DraftSession, float]] = []
        for request in sorted(requests, key=lambda r: float(r["t"])):
            start_s = base_s + float(request["t"])
            if request.get("type") == "subagent":
                child_base_s = start_s if self.relative else 0.0
                child_id = f"{session_id}::sa:{request.get('agent_id', len(children))}"
                child = self.session(child_id, list(request.get("requests") or []), child_base_s)
                children.append((child, start_s))
                continue
            draft.turns.append(self._turn(request, start_s, draft.turns))
        attach_children(draft, children)  # drops sub-agents without requests
        return draft

    def _turn(self, request: dict[str, Any], start_s: float, before: list[DraftTurn]) -> DraftTurn:
        api_s = float(request["api_time"]) if request.get("api_time") is not None else None
        if not before:
            pause_s = 0.0
        elif request.get("think_time") is not None:
            pause_s = float(request["think_time"])
        else:
            pause_s = start_s - before[-1].end_s
        input_len = int(request["in"])
        if input_len < 1:
            raise AgentTraceError(f"{self.where}: a request with in < 1")
        block_ids = self.blocks(self.scope, list(request.get("hash_ids") or []))
        end_s = start_s + (api_s or 0.0)
        prompt = Blocks(block_ids, input_len)
        return DraftTurn(
            prompt, max(1, int(request.get("out") or 0)), max(0.0, pause_s), start_s, end_s
        )
