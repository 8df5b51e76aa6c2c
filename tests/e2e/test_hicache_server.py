"""HiCache through `kvstrata serve`: a prompt served after its prefix moved L1 -> L2 ->
back, and after /flush_cache from L3, gives identical greedy output with the hits in
the right tier of `usage.kvstrata`; two servers share one `file` L3 directory."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
from server_harness import ServerProcess, assert_idle, start_server

from kvstrata import LLM, SamplingParams

PAGE = 4
PROMPT_LEN = 60
MAX_NEW = 8


def hicache_flags(l3_dir: Path) -> tuple[str, ...]:
    return (
        "--page-size", str(PAGE), "--num-kv-pages", "24", "--max-model-len", "256",
        "--enable-hierarchical-cache", "--hicache-ratio", "8",
        "--hicache-storage-backend", "file", "--hicache-storage-dir", str(l3_dir),
        "--hicache-storage-prefetch-policy", "wait_complete", "--hicache-prefetch-threshold", "4",
        "--log-level", "warning",
    )  # fmt: skip


def generate(http: httpx.Client, prompt: list[int]) -> dict:
    response = http.post(
        "/generate",
        json={
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
        },
    )
    assert response.status_code == 200, response.text
    return response.json()


def tiers(body: dict) -> tuple[int, int, int]:
    usage = body["usage"]["kvstrata"]
    return usage["cached_tokens_l1"], usage["cached_tokens_l2"], usage["cached_tokens_l3"]


def expected(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(model), page_size=PAGE, disable_radix_cache=True, num_kv_pages=256)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return [o.output_ids for o in llm.generate(input_ids=prompts, sampling_params=params)]


def stop(server: ServerProcess) -> None:
    assert server.stop() == 0, server.log()


def test_every_tier_gives_identical_output(tiny_llama: Path, tmp_path: Path) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(500) for _ in range(PROMPT_LEN)] for _ in range(3)]
    want = expected(tiny_llama, prompts)
    server = start_server(tiny_llama, tmp_path / "logs", *hicache_flags(tmp_path / "l3"))
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            first = [generate(http, p) for p in prompts]  # each evicts the one before from L1
            assert [b["output_ids"] for b in first] == want
            again = generate(http, prompts[0])  # L1 held only the last prompt: from L2
            assert again["output_ids"] == want[0]
            l1, l2, l3 = tiers(again)
            assert l2 > 0 and l3 == 0 and l1 + l2 == PROMPT_LEN - PAGE  # 59 matchable -> 56
            assert http.post("/flush_cache").status_code == 200
            from_l3 = generate(http, prompts[1])
            assert from_l3["output_ids"] == want[1]
            assert tiers(from_l3) == (0, 0, PROMPT_LEN - PAGE)  # 59 matchable -> 56
            metrics = http.get("/metrics").text
            assert "kvstrata_hicache_hit_tokens_l3 56.0" in metrics
            assert 'kvstrata_cached_tokens_total{tier="l3"} 56.0' in metrics
            cleared = http.post("/hicache/storage/clear")
            assert cleared.status_code == 200 and cleared.json()["num_deleted_pages"] > 0
            assert http.post("/flush_cache").status_code == 200
            cold = generate(http, prompts[2])
            assert cold["output_ids"] == want[2] and tiers(cold) == (0, 0, 0)
            assert_idle(http)
    finally:
        stop(server)


def test_second_server_reuses_the_first_ones_pages(tiny_llama: Path, tmp_path: Path) -> None:
    prompt = list(range(100, 100 + PROMPT_LEN))
    (want,) = expected(tiny_llama, [prompt])
    shared = tmp_path / "shared-l3"
    first = start_server(tiny_llama, tmp_path / "logs1", *hicache_flags(shared))
    try:
        with httpx.Client(base_url=first.base_url, timeout=120) as http:
            assert generate(http, prompt)["output_ids"] == want
            assert http.post("/flush_cache").status_code == 200  # waits for the L3 writes
    finally:
        stop(first)
    second = start_server(tiny_llama, tmp_path / "logs2", *hicache_flags(shared))
    try:
        with httpx.Client(base_url=second.base_url, timeout=120) as http:
            body = generate(http, prompt)
            assert body["output_ids"] == want
            assert tiers(body) == (0, 0, PROMPT_LEN - PAGE)
    finally:
        stop(second)


def test_clear_without_l3_is_refused(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        response = http.post("/hicache/storage/clear")
    assert response.status_code == 400
    assert "L3" in response.json()["error"]["message"]
