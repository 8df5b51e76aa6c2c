"""Engines free what they hold (issue 28.8). No part of an engine refers back to it, so a
dropped one dies by reference counting alone, its L1 pool with it: checked with the
collector off (as between two of its runs, which is when a cycle kept a discarded engine's
pool: four held 4.3 GiB). `close()`, `with Engine(...)` / `with LLM(...)` and the engine
thread's stop give the pool's memory back while the engine is still referenced."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstrata.config import EngineConfig
from kvstrata.core import SamplingParams
from kvstrata.disagg.factory import PD_ROLES
from kvstrata.engine.engine import Engine
from kvstrata.llm import LLM
from kvstrata.runtime.engine_loop import EngineLoop

_MIB = 1 << 20
PAGE = 16
PROMPTS = [list(range(1, 41)), list(range(1, 21)) + list(range(100, 130))]
SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
# One engine per PD role and stepper: each wires its parts differently.
MODES: dict[str, dict[str, Any]] = {
    "unified": {},
    "overlap": {"overlap_schedule": "on"},
    "no-radix": {"disable_radix_cache": True},
    "prefill": {"disaggregation_mode": "prefill"},
    # A CPU ipc decode rank: its pool is a shared-memory file; it prefills short prompts.
    "decode": {"disaggregation_mode": "decode", "disaggregation_decode_local_prefill": "threshold"},
    "hicache": {"enable_hierarchical_cache": True},
}


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def run_requests(engine: Engine) -> None:
    for prompt in PROMPTS:
        engine.add_request(prompt, SHORT)
    while engine.has_unfinished:
        engine.step()


def parts_of(engine: Engine) -> dict[str, weakref.ref[Any]]:
    """Weak references to the engine and the parts that referred back to it (the role and
    the stepper), those holding the pool, and the pool's tensor."""
    parts = {
        "engine": engine, "role": engine.role, "stepper": engine.stepper, "runner": engine.runner,
        "scheduler": engine.scheduler, "kv": engine.kv, "pool tensor": engine.pool.data,
    }  # fmt: skip
    if engine.config.l2.enabled:
        # HiRadixCache holds a cycle of its own (it and its HostCache's evict listener, a
        # closure over it: hiradix.py), which the collector frees; it holds the KVPool
        # object, whose memory goes as the engine dies all the same.
        del parts["kv"]
    else:
        # The prefix cache and its page index listen to each other (weakly: page_index.py).
        parts |= {"tiers": engine.tiers, "prefix cache": engine.cache, "pool": engine.pool}
    return {name: weakref.ref(part) for name, part in parts.items()}


@pytest.mark.parametrize("flags", MODES.values(), ids=MODES)
def test_a_dropped_engine_is_freed_by_reference_counting(
    tiny_llama: Path, flags: dict[str, Any]
) -> None:
    with collector_off():
        config = EngineConfig.from_flags(
            model=str(tiny_llama), page_size=PAGE, num_kv_pages=64, **flags
        )
        engine = Engine(config, PD_ROLES)
        run_requests(engine)
        parts = parts_of(engine)
        del engine
        assert [name for name, ref in parts.items() if ref() is not None] == []


def test_engines_made_and_dropped_in_a_loop_give_their_memory_back(tiny_llama: Path) -> None:
    """Four engines in turn, each with a 256 MiB pool made resident: its first pages by
    requests through the model, the rest written directly (computing 256 MiB of KV costs
    minutes on a 2-core box). Two are dropped, two closed first; none is collected."""
    pool_bytes = 256 * _MIB
    with collector_off():
        first = LLM(str(tiny_llama), page_size=PAGE, num_kv_pages=64)
        first.generate(input_ids=PROMPTS, sampling_params=SHORT)  # one-time costs first
        num_pages = pool_bytes // first.engine.pool.page_bytes
        del first
        baseline = rss_bytes()
        for index in range(4):
            llm = LLM(str(tiny_llama), page_size=PAGE, num_kv_pages=num_pages)
            llm.generate(input_ids=PROMPTS, sampling_params=SHORT)
            llm.engine.pool.data.fill_(1.0)
            assert rss_bytes() - baseline > pool_bytes * 3 // 4  # resident
            if index % 2:
                llm.close()
            del llm
            assert rss_bytes() - baseline < 64 * _MIB, f"engine {index}"


def test_close_gives_the_pool_back_while_the_engine_is_still_referenced(
    tiny_llama: Path,
) -> None:
    before = rss_bytes()
    with LLM(str(tiny_llama), page_size=PAGE, num_kv_pages=8192) as llm:  # 64 MiB
        llm.generate(input_ids=PROMPTS, sampling_params=SHORT)
        llm.engine.pool.data.fill_(1.0)
        assert rss_bytes() - before > 48 * _MIB
    assert rss_bytes() - before < 16 * _MIB
    assert llm.engine.pool.data.numel() == 0 and llm.engine.pool.k_cache == []
    llm.close()  # idempotent
    # An engine whose tiers keep a reference cycle (hicache) and one whose pool is a
    # shared-memory file (a CPU ipc decode rank, whose file goes with its transport).
    for name in ("hicache", "decode"):
        config = EngineConfig.from_flags(model=str(tiny_llama), page_size=PAGE, num_kv_pages=8192,
                              **MODES[name])  # fmt: skip
        with Engine(config, PD_ROLES) as engine:
            run_requests(engine)
            pool = weakref.ref(engine.pool.data)
            shm_path = engine.shm_path
        assert pool() is None, name
        assert shm_path is None or not shm_path.exists()


def test_the_engine_loop_closes_the_engine_when_it_stops(tiny_llama: Path) -> None:
    async def serve_one(loop: EngineLoop) -> None:
        loop.start()
        with loop.submit("a", PROMPTS[:1], SHORT) as group:
            await group.final_outputs()
        await loop.stop()

    config = EngineConfig.from_flags(model=str(tiny_llama), page_size=PAGE, num_kv_pages=64)
    started, never_started = Engine(config), Engine(config)
    asyncio.run(serve_one(EngineLoop(started)))
    asyncio.run(EngineLoop(never_started).stop())  # a rank that stops before it serves
    assert started.pool.data.numel() == never_started.pool.data.numel() == 0
