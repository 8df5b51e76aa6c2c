"""`kvstrata bench --workload agentic` over real HTTP against a stand-in rank on loopback
that records every /generate request's headers: each request names its session, a
sub-agent its parent, each session's last request says it is final, and the report
splits resumed turns by pause length (and survives its JSON round trip)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

from kvstrata.bench.config import BenchConfig
from kvstrata.bench.report import BenchReport
from kvstrata.bench.run import run_bench_async
from kvstrata.sim.agent_trace import build_agent_workload

SERVER_INFO = {
    "engine_config": {},
    "disaggregation_mode": "null",
    "page_size": 16,
    "vocab_size": 100,
    "max_seq_len": 100_000,
    "served_model_name": "stand-in",
}


class StandInRank:
    """Answers GET /server_info and streams one event per POST /generate (HTTP/1.1 with
    keep-alive); keeps the lower-cased headers of every /generate request."""

    def __init__(self) -> None:
        self.generate_headers: list[dict[str, str]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while request_line := await reader.readline():
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, value = line.decode().split(":", 1)
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            path = request_line.decode().split()[1]
            if path == "/generate":
                self.generate_headers.append(headers)
                max_tokens = json.loads(body)["sampling_params"]["max_new_tokens"]
                usage = {"prompt_tokens": 1, "completion_tokens": max_tokens}
                event = {"output_ids": [1] * max_tokens, "text": "", "usage": usage}
                payload = f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
                content_type = "text/event-stream"
            else:
                payload, content_type = json.dumps(SERVER_INFO).encode(), "application/json"
            writer.write(
                f"HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\n"
                f"content-length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
        writer.close()


def test_every_request_carries_its_session_identity() -> None:
    rank = StandInRank()
    shape = dict(
        workload="agentic",
        agentic_num_sessions=3,
        agentic_prefix_len=32,
        agentic_tool_result_len=8,
        agentic_tool_result_p99_len=32,
        agentic_output_len=4,
        agentic_turns=4.0,
        agentic_child_turns=2.0,
        agentic_spawn_prob=0.5,
        agentic_max_fanout=3,
        agentic_time_scale=1e5,
        progress=False,
        seed=2,
    )

    workload = build_agent_workload(BenchConfig(**shape), 2)  # type: ignore[arg-type]
    assert any(s.parent is not None for s in workload.sessions)  # it has sub-agents

    async def bench() -> None:
        server = await asyncio.start_server(rank.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        config = BenchConfig(url=f"http://127.0.0.1:{port}", **shape)  # type: ignore[arg-type]
        async with server:
            report = await run_bench_async(config)
        assert report.num_ok == report.num_requests == len(rank.generate_headers)
        # Every turn but each session's first is a resumed one.
        assert report.pauses and report.pauses[-1].bucket == "all"
        assert report.pauses[-1].num_requests == report.num_requests - len(workload.sessions)
        assert BenchReport.from_json(json.loads(json.dumps(report.to_json()))) == report

    asyncio.run(bench())
    sent = Counter(h["x-session-id"] for h in rank.generate_headers)
    assert sent == {s.session_id: len(s.turns) for s in workload.sessions}
    finals = Counter(h["x-session-id"] for h in rank.generate_headers if "x-session-final" in h)
    assert finals == dict.fromkeys(sent, 1)
    assert all(
        h["x-session-final"] == "true" for h in rank.generate_headers if "x-session-final" in h
    )
    for session in workload.sessions:
        parents = {
            h.get("x-parent-session-id")
            for h in rank.generate_headers
            if h["x-session-id"] == session.session_id
        }
        expected = (
            workload.sessions[session.parent].session_id if session.parent is not None else None
        )
        assert parents == {expected}
