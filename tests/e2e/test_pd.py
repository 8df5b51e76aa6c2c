"""PD disaggregation with real prefill and decode processes on loopback: PD output equals
unified output for multi-turn conversations with every decode cache setting, only the
new suffix is transferred, a flushed decode rank serves from L3, aborts and a killed
prefill rank leave nothing behind."""

from __future__ import annotations

import json
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from cluster_key import ROUTER_KEY
from mooncake_fixtures import require_mooncake
from pd_harness import (
    DECODE_CACHES,
    PAGE,
    assert_rank_idle,
    decode_l3_flags,
    generate,
    start_decode,
    start_prefill,
    unified,
)
from server_harness import ServerProcess

NUM_TURNS = 3


@pytest.fixture(scope="module")
def prefill(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_prefill(tiny_llama, tmp_path_factory.mktemp("prefill-logs"))
    yield server
    assert server.stop() == 0, server.log()


def conversation(seed: int) -> Iterator[list[int]]:
    """Turn k's new user tokens (the caller appends the previous answer itself)."""
    rng = random.Random(seed)
    while True:
        yield [rng.randrange(500) for _ in range(rng.randrange(9, 23))]


def run_turns(http: httpx.Client, model: Path, seed: int) -> list[dict]:
    history: list[int] = []
    bodies = []
    for _, new_tokens in zip(range(NUM_TURNS), conversation(seed)):
        history = history + new_tokens
        response = generate(http, history)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["output_ids"] == unified(model, [history])[0]
        bodies.append(body | {"prompt_len": len(history)})
        history = history + body["output_ids"]
    return bodies


@pytest.mark.parametrize("cache", [*DECODE_CACHES, "l1l2l3"])
def test_multi_turn_pd_equals_unified(
    tiny_llama: Path, prefill: ServerProcess, tmp_path: Path, cache: str
) -> None:
    flags = decode_l3_flags(tmp_path / "l3") if cache == "l1l2l3" else DECODE_CACHES[cache]
    decode = start_decode(tiny_llama, tmp_path / "logs", [prefill.base_url], *flags)
    try:
        with httpx.Client(base_url=decode.base_url, timeout=120) as http:
            turns = run_turns(http, tiny_llama, seed=11)
            for k, body in enumerate(turns):
                usage = body["usage"]["kvstrata"]
                cached = usage["cached_tokens_l1"] + usage["cached_tokens_l2"]
                cached += usage["cached_tokens_l3"]
                assert cached + usage["transferred_tokens"] == body["prompt_len"]
                if cache == "off":
                    assert usage["transferred_tokens"] == body["prompt_len"]
                elif k > 0:
                    previous = turns[k - 1]
                    seen_len = previous["prompt_len"] + len(previous["output_ids"]) - 1
                    new_suffix = body["prompt_len"] - seen_len
                    assert usage["transferred_tokens"] <= new_suffix + PAGE
            if cache == "l1l2l3":
                # Every rank flushed: the next turn of the conversation comes from L3.
                assert http.post("/flush_cache").status_code == 200
                with httpx.Client(base_url=prefill.base_url, timeout=60) as prefill_http:
                    assert prefill_http.post("/flush_cache").status_code == 200
                last_prompt = _replay(turns, 11)
                body = generate(http, last_prompt).json()
                assert body["usage"]["kvstrata"]["cached_tokens_l3"] > 0
                assert body["output_ids"] == unified(tiny_llama, [last_prompt])[0]
            assert_rank_idle(http)
    finally:
        assert decode.stop() == 0, decode.log()


def _replay(turns: list[dict], seed: int) -> list[int]:
    """The full last prompt of a conversation `run_turns` served (prompts + answers)."""
    history: list[int] = []
    for body, new_tokens in zip(turns, conversation(seed)):
        history = history + new_tokens
        if body is not turns[-1]:
            history = history + body["output_ids"]
    return history


def wait_for(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def rank_idle(http: httpx.Client) -> bool:
    load = http.get("/get_load").json()
    return load["num_running_reqs"] + load["num_waiting_reqs"] + load["num_pd_rooms"] == 0


def stream_and_leave(base_url: str, prompt: list[int], num_events: int) -> None:
    body = {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True},
    }
    with (
        httpx.Client(base_url=base_url, timeout=120) as http,
        http.stream("POST", "/generate", json=body) as response,
    ):
        if num_events == 0:
            return  # leave as soon as the response started, before any token
        for i, _ in enumerate(response.iter_lines()):
            if i >= num_events:
                break  # leave mid-stream: the rank must abort and free everything


def test_abort_storm_leaves_every_rank_idle(
    tiny_llama: Path, prefill: ServerProcess, tmp_path: Path
) -> None:
    decode = start_decode(tiny_llama, tmp_path / "logs", [prefill.base_url], *DECODE_CACHES["l1"])
    rng = random.Random(5)
    try:
        clients = [
            threading.Thread(
                target=stream_and_leave,
                args=(decode.base_url, [rng.randrange(500) for _ in range(rng.randrange(8, 60))],
                      rng.randrange(0, 12)),
            )
            for _ in range(32)
        ]  # fmt: skip
        for client in clients:
            client.start()
        for client in clients:
            client.join(timeout=120)
        with (
            httpx.Client(base_url=decode.base_url, timeout=60) as http,
            httpx.Client(base_url=prefill.base_url, timeout=60) as prefill_http,
        ):
            wait_for(lambda: rank_idle(http) and rank_idle(prefill_http))
            assert_rank_idle(http)
            assert_rank_idle(prefill_http)
            prompt = list(range(7, 40))
            response = generate(http, prompt)
            assert response.json()["output_ids"] == unified(tiny_llama, [prompt])[0]
    finally:
        assert decode.stop() == 0, decode.log()


def test_room_pages_wait_for_a_frozen_prefill_rank(tiny_llama: Path, tmp_path: Path) -> None:
    """A client leaves while its room sits on a frozen prefill rank: the decode rank must
    not reuse the room's pages until the prefill rank confirms it will not write."""
    frozen = start_prefill(tiny_llama, tmp_path / "p-logs")
    decode = start_decode(tiny_llama, tmp_path / "d-logs", [frozen.base_url])
    try:
        with httpx.Client(base_url=decode.base_url, timeout=60) as http:
            frozen.proc.send_signal(signal.SIGSTOP)
            # The response waits for the first token (which needs the frozen rank), so the
            # client sends its request on a bare socket and hangs up once the room exists.
            body = json.dumps({"input_ids": list(range(30)), "stream": True,
                               "sampling_params": {"max_new_tokens": 40}}).encode()  # fmt: skip
            url = httpx.URL(decode.base_url)
            client = socket.create_connection((url.host, url.port))
            client.sendall(
                f"POST /generate HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            wait_for(lambda: http.get("/get_load").json()["num_pd_rooms"] == 1)
            client.close()  # left before any token arrived
            # The decode rank gives the request up, but not the room's pages (a zombie
            # room): the frozen rank has not confirmed the abort.
            wait_for(lambda: http.get("/debug/invariants").json()["counts"]["zombie_rooms"] == 1)
            load = http.get("/get_load").json()
            assert load["num_pd_rooms"] == 1 and load["num_used_pages"] > 0  # held back
            frozen.proc.send_signal(signal.SIGCONT)
            wait_for(lambda: rank_idle(http))
            assert_rank_idle(http)
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
        assert decode.stop() == 0, decode.log()
        frozen.stop()


def test_killed_prefill_rank_fails_its_requests_only(tiny_llama: Path, tmp_path: Path) -> None:
    doomed = start_prefill(tiny_llama, tmp_path / "p1-logs")
    healthy = start_prefill(tiny_llama, tmp_path / "p2-logs")
    # The policy that fails requests (the default retries them elsewhere or recomputes
    # them: tests/faults/test_fault_policy.py).
    decode = start_decode(
        tiny_llama, tmp_path / "d-logs", [doomed.base_url],
        "--disaggregation-kv-failure-policy", "fail",
    )  # fmt: skip
    try:
        with httpx.Client(base_url=decode.base_url, timeout=120) as http:
            doomed.proc.send_signal(signal.SIGSTOP)  # requests pile up mid-handoff...
            results: list[httpx.Response] = []
            clients = [
                threading.Thread(
                    target=lambda p=p: results.append(generate(http, list(range(p, p + 25))))
                )
                for p in range(4)
            ]
            for client in clients:
                client.start()
            wait_for(lambda: http.get("/get_load").json()["num_pd_rooms"] == 4)
            doomed.proc.kill()  # ...and the prefill rank dies under them
            for client in clients:
                client.join(timeout=60)
            assert len(results) == 4
            for response in results:
                assert response.status_code == 503
                assert "prefill" in response.json()["error"]["message"]
            wait_for(lambda: rank_idle(http))
            assert_rank_idle(http)
            prompt = list(range(50, 80))
            served = generate(
                http, prompt, **{"X-Kvstrata-Prefill-Url": healthy.base_url}, **ROUTER_KEY
            )
            assert served.status_code == 200
            assert served.json()["output_ids"] == unified(tiny_llama, [prompt])[0]
    finally:
        assert decode.stop() == 0, decode.log()
        healthy.stop()
        doomed.stop()


@pytest.mark.parametrize("mooncake_config", ["{}", '{"host_staging": true}'],
                         ids=["default", "host-staging"])  # fmt: skip
def test_pd_over_mooncake_transfer_engine(
    tiny_llama: Path, tmp_path: Path, mooncake_config: str
) -> None:
    """The same conversation over the Mooncake Transfer Engine (tcp, P2P handshake); with
    host staging, every write goes through the decode rank's staging slots."""
    require_mooncake()
    backend = ("--disaggregation-transfer-backend", "mooncake",
               "--disaggregation-mooncake-config", mooncake_config)  # fmt: skip
    prefill_mc = start_prefill(tiny_llama, tmp_path / "p-logs", *backend)
    decode = start_decode(
        tiny_llama, tmp_path / "d-logs", [prefill_mc.base_url], *backend, *DECODE_CACHES["l1"]
    )
    try:
        with httpx.Client(base_url=decode.base_url, timeout=120) as http:
            turns = run_turns(http, tiny_llama, seed=12)
            assert turns[0]["usage"]["kvstrata"]["transferred_tokens"] == turns[0]["prompt_len"]
            assert all(t["usage"]["kvstrata"]["cached_tokens_l1"] > 0 for t in turns[1:])
            assert_rank_idle(http)
    finally:
        assert decode.stop() == 0, decode.log()
        assert prefill_mc.stop() == 0, prefill_mc.log()
