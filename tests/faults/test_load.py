"""A bounded load test: 500 concurrent streaming requests through the router to a 1 prefill
+ 2 decode tiny cluster on loopback (asyncio + httpx). Every stream completes with the
unified reference's tokens, the invariants hold afterwards, and every process's memory is
back near its idle level (what a per-request leak would break)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fault_cluster import FaultCluster
from fault_load import MAX_NEW_TOKENS, PAGE_SIZE, Reference

pytestmark = pytest.mark.slow

NUM_CONCURRENT = 500
NUM_DISTINCT_PROMPTS = 125  # each sent 4 times: prefix-cache hits under load too
# Resident memory may stay above idle after a burst (allocator arenas, socket and torch
# buffers are kept for reuse); a leak of even 0.4 MiB per request would exceed this.
RSS_MARGIN_BYTES = 200 << 20
COMMON = ("--page-size", str(PAGE_SIZE), "--max-model-len", "256", "--log-level", "warning")


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    with FaultCluster(
        tiny_llama, tmp_path_factory.mktemp("load-logs"),
        prefill_flags=(*COMMON, "--num-kv-pages", "2048"),
        decode_flags=(*COMMON, "--num-kv-pages", "4096",
                      "--disaggregation-decode-enable-radix-cache"),
        num_decode=2,
    ) as started:  # fmt: skip
        yield started
        assert not started.tracebacks(), started.tracebacks()


async def stream(client: httpx.AsyncClient, prompt: list[int]) -> list[int] | str:
    """The output ids of one streamed /generate, or what went wrong."""
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0,
                                "ignore_eos": True}}  # fmt: skip
    try:
        async with client.stream("POST", "/generate", json=body) as response:
            if response.status_code != 200:
                return f"{response.status_code}: {(await response.aread())[:200]!r}"
            events = [line[6:] async for line in response.aiter_lines()
                      if line.startswith("data: ")]  # fmt: skip
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    if not events or events[-1] != "[DONE]":
        return f"no [DONE] after {len(events)} events"
    chunks = [json.loads(event) for event in events[:-1]]
    if any("error" in chunk for chunk in chunks):
        return f"error event: {chunks[-1]}"
    return [t for chunk in chunks for t in chunk["output_ids"]]


async def burst(url: str, prompts: list[list[int]]) -> list[list[int] | str]:
    """Every prompt at once, each on its own connection (bounded by a timeout)."""
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        return await asyncio.wait_for(
            asyncio.gather(*(stream(client, prompt) for prompt in prompts)), timeout=600
        )


def test_500_concurrent_streams(cluster: FaultCluster, reference: Reference) -> None:
    rng = random.Random(41)
    distinct = [[rng.randrange(500) for _ in range(rng.randrange(8, 40))]
                for _ in range(NUM_DISTINCT_PROMPTS)]  # fmt: skip
    prompts = distinct * (NUM_CONCURRENT // NUM_DISTINCT_PROMPTS)
    rng.shuffle(prompts)
    expected = reference.outputs([(p, MAX_NEW_TOKENS) for p in distinct])
    want = {tuple(p): out for p, out in zip(distinct, expected)}
    # Warm up every code path (thread pools, buffers) before the idle measurement.
    warm = asyncio.run(burst(cluster.url, distinct[:50]))
    assert warm == expected[:50], [w for w in warm if isinstance(w, str)][:3]
    cluster.settle()
    idle_rss = {proc.name: proc.rss_bytes() for proc in cluster.procs}

    results = asyncio.run(burst(cluster.url, prompts))
    errors = [r for r in results if isinstance(r, str)]
    assert not errors, f"{len(errors)} of {len(results)} failed, e.g. {errors[:3]}"
    wrong = [p for p, r in zip(prompts, results) if r != want[tuple(p)]]
    assert not wrong, f"{len(wrong)} streams differ from the unified reference"
    cluster.settle()
    for proc in cluster.procs:
        growth_bytes = proc.rss_bytes() - idle_rss[proc.name]
        assert growth_bytes < RSS_MARGIN_BYTES, f"{proc.name}: +{growth_bytes >> 20} MiB"
