"""Containment on CUDA (docs/reliability.md, "Containment"): a row whose probabilities
are NaN is refused without the device-side assert `torch.multinomial` would raise, so the
CUDA context survives and the batch's other rows sample as they do alone; and a real
device-side assert in a rank's step (tests/e2e/poison_site) fails the request with 500
`engine_failed` and ends the process with status 70, instead of leaving a rank that
answers 503 to everything while it lives."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest
import torch

from kvstrata import LLM, SamplingParams
from kvstrata.core import ErrorKind, Request
from kvstrata.engine.sampler import Sampler

E2E = Path(__file__).parents[1] / "e2e"
POISON_SITE = E2E / "poison_site"
sys.path.insert(0, str(E2E))
from server_harness import start_server  # noqa: E402 - the suite's rank starter

POISON_PREFIX = [424, 242, 424, 242]  # poison_site/sitecustomize.py's
HOT = SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True)


def test_a_nan_row_fails_alone_and_the_device_lives() -> None:
    logits = torch.randn(3, 1000, device="cuda")
    logits[1] = float("nan")
    requests = [Request(rid, [1], HOT) for rid in ("a", "bad", "c")]
    sampled = Sampler(default_seed=0).sample(logits, requests)
    assert [f.request.rid for f in sampled.failures] == ["bad"]
    alone = Sampler(default_seed=0).sample(logits[[0, 2]], [requests[0], requests[2]])
    assert sampled.token_ids == alone.token_ids
    assert torch.ones(4, device="cuda").sum().item() == 4.0  # no sticky CUDA error


def test_an_engine_request_whose_rows_are_nan_fails_alone(tiny_llama: Path) -> None:
    llm = LLM(tiny_llama, device="cuda", dtype="float32", page_size=16, num_kv_pages=256)
    engine = llm.engine
    real_run = engine.runner.run

    def run(batch):  # type: ignore[no-untyped-def]
        logits = real_run(batch).clone()  # the runner's logits are inference tensors
        rows = [item.request for item in batch.items if item.samples]
        for k, req in enumerate(rows):
            if req.prompt_ids[0] == 7:
                logits[k] = float("nan")  # as an fp16 overflow in the model would leave it
        return logits

    engine.runner.run = run  # type: ignore[method-assign]
    good = engine.add_request([5, 6, 8, 9], HOT)
    bad = engine.add_request([7, 6, 8, 9], HOT)
    finals = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finals[out.rid] = out
    assert finals[bad.rid].error is not None
    assert finals[bad.rid].error.kind is ErrorKind.FAILED
    assert finals[good.rid].error is None and len(finals[good.rid].output_ids) == 6
    (again,) = llm.generate(input_ids=[[5, 6, 8, 9]], sampling_params=HOT)
    assert again.output_ids == finals[good.rid].output_ids  # seeded: the same draws


def test_a_device_side_assert_ends_the_rank_with_status_70(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The rank (and only it) loads the fault: its PYTHONPATH names poison_site.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(POISON_SITE), *sys.path]))
    monkeypatch.setenv("KVSTRATA_TEST_POISON", "device_assert")
    rank = start_server(tiny_llama, tmp_path, "--device", "cuda", "--num-kv-pages", "256",
                        "--page-size", "16", "--log-level", "warning")  # fmt: skip
    try:
        body = {"input_ids": [*POISON_PREFIX, 5, 6], "sampling_params": {"max_new_tokens": 4}}
        answer = httpx.post(f"{rank.base_url}/generate", json=body, timeout=120)
        assert answer.status_code == 500, answer.text
        assert answer.json()["error"]["code"] == "engine_failed"
        assert rank.proc.wait(timeout=60) == 70, rank.log()
    finally:
        rank.stop()
    assert "the engine failed in a step running requests" in rank.log()
