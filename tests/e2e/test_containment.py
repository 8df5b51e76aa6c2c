"""One request can only fail itself (issue 27, items 1 and 2), in a real 1 prefill + 2
decode `kvstrata launch` cluster: a request that masks every token while min_tokens holds
gets a 400 on every route and no rank restarts; bodies that would cost a rank without
bound are refused while other clients are served; and an engine failure no request can be
pinned on (a device-side assert, injected by tests/e2e/poison_site) fails that request
with a 500 that says it was not retried, ends only the rank it happened on, which
`kvstrata launch` starts again, and the cluster goes on answering exactly."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_supervision import Launcher, start_launcher, wait_until

from kvstrata import LLM, SamplingParams

POISON_SITE = Path(__file__).parent / "poison_site"
sys.path.insert(0, str(POISON_SITE))
from sitecustomize import POISON_PREFIX  # noqa: E402 - the injected fault's marker

VOCAB = 515  # the tiny llama's
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


@pytest.fixture(scope="module")
def launched(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(POISON_SITE), os.environ.get("PYTHONPATH", "")]),
        "KVSTRATA_TEST_POISON": "1",
    }
    launcher = start_launcher(
        tiny_llama, tmp_path_factory.mktemp("containment"), "--num-prefill", "1",
        "--num-decode", "2", "--restart-backoff-s", "0.5", "--rank-devices", "cpu", "cpu",
        "cpu", "--dtype", "float32", env=env,
    )  # fmt: skip
    yield launcher
    launcher.proc.terminate()
    launcher.proc.wait(timeout=120)


def router(launcher: Launcher) -> httpx.Client:
    return httpx.Client(base_url=launcher.children()["router"][0], timeout=120)


def greedy(http: httpx.Client, prompt: list[int], max_new_tokens: int = 8) -> httpx.Response:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }
    return http.post("/generate", json=body)


def expected(tiny_llama: Path, prompt: list[int], max_new_tokens: int = 8) -> list[int]:
    llm = LLM(str(tiny_llama), page_size=16, dtype="float32", disable_radix_cache=True)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    return llm.generate(input_ids=[prompt], sampling_params=params)[0].output_ids


def exits(launcher: Launcher) -> list[str]:
    return [line for line in launcher.output if " exited with status " in line]


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


def test_a_request_that_masks_every_token_fails_alone(launched: Launcher, tiny_llama: Path) -> None:
    everything = list(range(VOCAB))
    bodies = {
        "/v1/completions": {"prompt": [5, 6, 7], "max_tokens": 4, "min_tokens": 3,
                            "temperature": 1.0, "stop_token_ids": everything},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 4, "min_tokens": 3, "stop_token_ids": everything},
        "/generate": {"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 4, "min_new_tokens": 3, "temperature": 1.0,
            "stop_token_ids": everything}},
    }  # fmt: skip
    with router(launched) as http:
        for path, body in bodies.items():
            for _ in range(3):  # again and again: each one fails alone, at the door
                error = assert_error(http.post(path, json=body), 400, "invalid_value")
                assert error["param"] == "stop_token_ids" and "min_" in error["message"]
        answer = greedy(http, PROMPT)
        assert answer.status_code == 200, answer.text
        assert answer.json()["output_ids"] == expected(tiny_llama, PROMPT)
    assert not exits(launched), exits(launched)


def test_amplifying_bodies_are_refused_while_others_are_served(
    launched: Launcher, tiny_llama: Path
) -> None:
    amplifying = [  # (body, param): each once cost a rank without bound
        ({"prompt": [[5]] * 20_000, "n": 128, "max_tokens": 16}, "prompt"),
        ({"prompt": [[5]] * 100, "n": 8, "max_tokens": 16}, "n"),
        ({"prompt": [5, 6], "n": 128, "max_tokens": 900, "logprobs": 20}, "max_tokens"),
    ]
    answers: list[httpx.Response] = []

    def other_client() -> None:
        with router(launched) as http:
            answers.extend(greedy(http, PROMPT) for _ in range(3))

    served = threading.Thread(target=other_client)
    served.start()
    with router(launched) as http:
        for body, param in amplifying:
            assert assert_error(http.post("/v1/completions", json=body), 400)["param"] == param
    served.join(300)
    want = expected(tiny_llama, PROMPT)
    assert [a.status_code for a in answers] == [200] * 3
    assert all(a.json()["output_ids"] == want for a in answers)
    assert not exits(launched), exits(launched)


def test_an_engine_failure_ends_one_rank_and_is_not_retried(
    launched: Launcher, tiny_llama: Path
) -> None:
    with router(launched) as http:
        error = assert_error(greedy(http, [*POISON_PREFIX, *PROMPT]), 500)
        assert error["code"] in ("engine_failed", "request_failed"), error
        assert "not retried" in error["message"], error
        line = launched.wait_for(" exited with status 70; restart 1 ")
        launched.wait_for("is healthy again")
        assert exits(launched) == [line]  # only the rank it broke, and only once
        want = expected(tiny_llama, PROMPT)
        wait_until(lambda: greedy(http, PROMPT).status_code == 200, "the cluster serves again")
        for _ in range(4):
            answer = greedy(http, PROMPT)
            assert answer.status_code == 200 and answer.json()["output_ids"] == want
