"""Agent sessions on live ranks (issue 34): the session headers (kvstrata's and Dynamo's
spellings) make a request a turn of a session, `GET /sessions/{id}` shows it paused
between turns and closed after its final one, a Responses API chain is one session, bad
ids are 400s naming the header and unknown ones 404s; through PD, a decode rank's paused
session demoted to L2 by pressure comes back to L1 on `POST /sessions/{id}/prefetch`, so
its next turn finds its whole history in L1 and only the new suffix is transferred."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pd_harness import MAX_NEW, PAGE, assert_rank_idle, generate, start_decode, start_prefill
from server_harness import ServerProcess


def test_session_headers_states_and_errors(http: httpx.Client) -> None:
    history = list(range(10, 40))
    first = generate(http, history, **{"X-Session-ID": "agent-7"})
    assert first.status_code == 200, first.text
    info = http.get("/sessions/agent-7").json()
    assert info["state"] == "paused" and info["num_turns"] == 1, info
    assert info["num_cached_tokens"] > 0
    history += first.json()["output_ids"] + [41, 42]
    last = generate(http, history, **{"X-Dynamo-Session-ID": "agent-7", "X-Session-Final": "1"})
    assert last.status_code == 200, last.text
    info = http.get("/sessions/agent-7").json()
    assert info["state"] == "closed" and info["num_turns"] == 2, info
    assert http.delete("/sessions/agent-7").json()["closed"] is True

    bad = generate(http, history, **{"X-Session-ID": "has space"})
    assert bad.status_code == 400 and "x-session-id" in bad.json()["error"]["message"]
    bad = generate(http, history, **{"X-Session-ID": "a", "X-Parent-Session-ID": "a"})
    assert bad.status_code == 400, bad.text
    bad = generate(http, history, **{"X-Session-ID": "a", "X-Session-Final": "maybe"})
    assert bad.status_code == 400 and "x-session-final" in bad.json()["error"]["message"]
    too_long = http.get("/sessions/" + "a" * 129)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "session_id"
    assert http.post("/sessions/%20x/prefetch").status_code == 400  # a space
    assert http.get("/sessions/nobody").status_code == 404
    assert http.delete("/sessions/nobody").status_code == 404
    assert http.post("/sessions/nobody/prefetch").status_code == 404
    metrics = http.get("/metrics").text
    assert "kvstrata_sessions_closed" in metrics and "kvstrata_session_turns_started" in metrics
    assert_rank_idle(http)


def test_a_responses_chain_is_one_session(http: httpx.Client) -> None:
    body = {"model": "tiny", "input": "hello there", "max_output_tokens": 4, "temperature": 0}
    first = http.post("/v1/responses", json=body)
    assert first.status_code == 200, first.text
    first_id = first.json()["id"]
    follow = http.post("/v1/responses", json=body | {"previous_response_id": first_id})
    assert follow.status_code == 200, follow.text
    info = http.get(f"/sessions/{first_id}").json()
    assert info["num_turns"] == 2 and info["state"] == "paused", info


# -- through PD ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pd_pair(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    logs = tmp_path_factory.mktemp("session-pd-logs")
    prefill = start_prefill(tiny_llama, logs)
    decode = start_decode(
        tiny_llama,
        logs,
        [prefill.base_url],
        "--disaggregation-decode-enable-radix-cache",
        "--disaggregation-decode-enable-hicache",
        "--disaggregation-decode-hicache-ratio",
        "4",
        "--disaggregation-decode-hicache-write-policy",
        "write_through_selective",
        "--num-kv-pages",
        "40",
    )
    yield prefill, decode
    assert decode.stop() == 0, decode.log()
    assert prefill.stop() == 0, prefill.log()


def test_prefetch_on_resume_through_pd(pd_pair: tuple[ServerProcess, ServerProcess]) -> None:
    _, decode = pd_pair
    with httpx.Client(base_url=decode.base_url, timeout=60) as http:
        history = [3 + i % 400 for i in range(96)]  # 24 pages
        first = generate(http, history, **{"X-Session-ID": "resume-1"})
        assert first.status_code == 200, first.text
        history += first.json()["output_ids"]
        # another request that needs most of L1 (40 pages): the paused session is demoted
        pressure = generate(http, [100 + i for i in range(120)])
        assert pressure.status_code == 200, pressure.text
        context = (96 + MAX_NEW - 1) // PAGE * PAGE  # its full pages of computed KV
        started = http.post("/sessions/resume-1/prefetch").json()
        assert started["num_context_tokens"] == context, started
        assert started["num_l2_tokens"] > 0, started  # demoted by the pressure, not dropped
        assert started["num_l1_tokens"] + started["num_l2_tokens"] == context, started
        history += [7, 8, 9, 10, 11, 12, 13, 14]
        second = generate(http, history, **{"X-Session-ID": "resume-1"})
        assert second.status_code == 200, second.text
        usage = second.json()["usage"]["kvstrata"]
        assert usage["cached_tokens_l1"] == context, usage  # all of it in L1
        assert usage["cached_tokens_l2"] == 0, usage
        assert usage["transferred_tokens"] == len(history) - context, usage
        assert_rank_idle(http)
