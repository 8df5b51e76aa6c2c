"""`POST /start_profile` / `/stop_profile` through `kvstrata serve`: a trace of the engine's
steps lands under --profile-dir only (never where a caller says), one profile at a time,
a step budget stops it by itself, bad bodies get 4xx, and the rank keeps serving."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import httpx
from server_harness import assert_idle, start_server

FLAGS = ("--page-size", "4", "--num-kv-pages", "64", "--max-model-len", "128")


def generate(http: httpx.Client, max_new_tokens: int) -> list[int]:
    response = http.post(
        "/generate",
        json={
            "input_ids": list(range(1, 20)),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        },
    )
    assert response.status_code == 200, response.text
    return response.json()["output_ids"]


def step_marks(trace_path: Path) -> list[str]:
    with gzip.open(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return [e["name"] for e in events if e.get("name", "").startswith("kvstrata_step ")]


def test_a_profile_records_the_steps_under_the_profile_dir(
    tiny_llama: Path, tmp_path: Path
) -> None:
    profile_dir = tmp_path / "profiles"
    server = start_server(tiny_llama, tmp_path / "logs", *FLAGS, "--profile-dir", str(profile_dir))
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            want = generate(http, 8)
            for body in ({"output_dir": str(tmp_path)}, {"num_steps": 0}, {"num_steps": "3"}):
                refused = http.post("/start_profile", json=body)
                assert refused.status_code in (400, 422), (body, refused.text)
                assert "error" in refused.json()
            assert http.post("/stop_profile").status_code == 400  # none running

            started = http.post("/start_profile")
            assert started.status_code == 200, started.text
            trace_path = Path(started.json()["trace_path"])
            assert trace_path.parent == profile_dir
            again = http.post("/start_profile", json={"num_steps": 5})
            assert again.status_code == 409 and "already running" in again.text
            assert generate(http, 8) == want  # the profiled steps give the same tokens
            stopped = http.post("/stop_profile")
            assert stopped.status_code == 200, stopped.text
            assert stopped.json()["trace_path"] == str(trace_path)
            assert stopped.json()["num_steps"] >= 8
            marks = step_marks(trace_path)
            assert len(marks) == stopped.json()["num_steps"]
            assert "kvstrata_step running=1 kv_tokens=" in marks[-1]

            # A step budget stops the profile by itself; the next stop names it, once.
            budget = http.post("/start_profile", json={"num_steps": 3})
            assert budget.status_code == 200 and budget.json()["num_steps"] == 3
            assert generate(http, 8) == want
            stopped = http.post("/stop_profile")
            assert stopped.status_code == 200 and stopped.json()["num_steps"] == 3
            assert len(step_marks(Path(stopped.json()["trace_path"]))) == 3
            assert http.post("/stop_profile").status_code == 400
            assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "profiles"]
            assert generate(http, 8) == want
            assert_idle(http)
    finally:
        assert server.stop() == 0, server.log()


def test_profiling_is_off_without_a_profile_dir(tiny_llama: Path, tmp_path: Path) -> None:
    server = start_server(tiny_llama, tmp_path / "logs", *FLAGS)
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            for path in ("/start_profile", "/stop_profile"):
                refused = http.post(path)
                assert refused.status_code == 400
                assert "--profile-dir" in refused.json()["error"]["message"]
            assert generate(http, 4)  # the rank serves
    finally:
        assert server.stop() == 0, server.log()
