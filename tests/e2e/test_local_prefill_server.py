"""Local prefill behind a decode rank's HTTP API (real processes): later turns of a
conversation are prefilled by the decode rank itself, outputs equal unified, usage and
/metrics say which path each request took, and nothing is left behind."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
from pd_harness import (
    DECODE_CACHES,
    assert_rank_idle,
    generate,
    start_decode,
    start_prefill,
    unified,
)
from server_harness import ServerProcess


def metric(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_short_suffixes_are_prefilled_on_the_decode_rank(tiny_llama: Path, tmp_path: Path) -> None:
    prefill: ServerProcess = start_prefill(tiny_llama, tmp_path / "prefill")
    decode = start_decode(
        tiny_llama, tmp_path / "decode", [prefill.base_url], *DECODE_CACHES["l1l2"],
        "--disaggregation-decode-local-prefill", "threshold",
        "--disaggregation-decode-local-prefill-max-tokens", "24",
        "--disaggregation-decode-local-prefill-chunk-tokens", "8",
    )  # fmt: skip
    try:
        rng = random.Random(5)
        history: list[int] = []
        paths = []
        with httpx.Client(base_url=decode.base_url, timeout=120) as http:
            for turn in range(4):
                history = history + [rng.randrange(500) for _ in range(40 if turn == 0 else 11)]
                response = generate(http, history)
                assert response.status_code == 200, response.text
                body = response.json()
                assert body["output_ids"] == unified(tiny_llama, [history])[0]
                usage = body["usage"]["kvstrata"]
                cached = sum(usage[f"cached_tokens_l{i}"] for i in (1, 2, 3))
                if usage["local_prefill_tokens"]:
                    paths.append("local")
                    assert usage["transferred_tokens"] == 0
                    assert cached + usage["local_prefill_tokens"] == len(history)
                else:
                    paths.append("remote")
                    assert cached + usage["transferred_tokens"] == len(history)
                history = history + body["output_ids"]
            assert paths == ["remote", "local", "local", "local"]
            text = http.get("/metrics").text
            assert metric(text, 'kvstrata_pd_prefill_requests_total{path="local"}') == 3
            assert metric(text, 'kvstrata_pd_prefill_requests_total{path="remote"}') == 1
            assert metric(text, 'kvstrata_pd_prefill_tokens_total{path="remote"}') == 40
            assert metric(text, 'kvstrata_pd_prefill_tokens_total{path="local"}') > 0
            assert_rank_idle(http)
            report = http.get("/debug/invariants").json()
            assert report["ok"], report
            assert report["counts"]["dispatcher_targets"] == 0
            assert http.get("/get_load").json()["max_local_prefill_tokens"] == 24
        with httpx.Client(base_url=prefill.base_url, timeout=30) as http:
            text = http.get("/metrics").text
            assert metric(text, "kvstrata_computed_prompt_tokens_total") == 40
    finally:
        assert decode.stop() == 0, decode.log()
        assert prefill.stop() == 0, prefill.log()
