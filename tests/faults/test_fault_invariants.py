"""The invariants check itself, in process (no HTTP): it holds after every engine step of
unified, L1/L2/L3, preempting and PD runs, and names each kind of break it is built to
catch (a leaked page, a stray lock, an orphan prefetch, a room or page held twice)."""

from __future__ import annotations

import random
from pathlib import Path

from kvstrata import LLM, SamplingParams
from kvstrata.disagg.rooms import RoomState
from kvstrata.engine.engine import Engine
from kvstrata.engine.invariants import check_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PAGE = 4


def assert_ok(engine: Engine) -> dict[str, int]:
    report = check_engine(engine)
    assert report.ok, report.violations
    return report.counts


def run_checked(engine: Engine, prompts: list[list[int]]) -> None:
    """Run `prompts` to completion, checking the invariants after every step."""
    for prompt in prompts:
        engine.add_request(prompt, GREEDY)
    assert_ok(engine)
    while engine.has_unfinished:
        engine.step()
        assert_ok(engine)


def prompts(seed: int, num: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(500) for _ in range(20)]  # a common prefix: locks are shared
    return [shared + [rng.randrange(500) for _ in range(rng.randrange(3, 30))] for _ in range(num)]


def test_holds_through_unified_runs_with_every_tier_and_preemption(
    tiny_llama: Path, tmp_path: Path
) -> None:
    l1 = LLM(str(tiny_llama), page_size=PAGE, num_kv_pages=64).engine
    run_checked(l1, prompts(0))
    tiers = LLM(
        str(tiny_llama), page_size=PAGE, num_kv_pages=40, enable_hierarchical_cache=True,
        hicache_ratio=1.0, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
        hicache_storage_prefetch_policy="wait_complete", hicache_prefetch_threshold=4,
    ).engine  # fmt: skip
    run_checked(tiers, prompts(1))
    assert tiers.flush_cache()
    run_checked(tiers, prompts(1))  # now through L3 prefetches into L2
    counts = assert_ok(tiers)
    assert counts["l2_indexed_pages"] > 0 and counts["requests"] == 0
    # 24 pages for 6 requests of up to 62 tokens: running requests must be preempted.
    tight = LLM(str(tiny_llama), page_size=PAGE, num_kv_pages=24).engine
    run_checked(tight, prompts(2))
    counts = assert_ok(tight)
    assert counts["num_preemptions"] > 0
    assert check_engine(tight).idle


def test_names_a_leaked_page_a_stray_lock_and_an_orphan_prefetch(
    tiny_llama: Path, tmp_path: Path
) -> None:
    engine = LLM(
        str(tiny_llama), page_size=PAGE, num_kv_pages=64, enable_hierarchical_cache=True,
        hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
    ).engine  # fmt: skip
    run_checked(engine, prompts(3, num=2))
    (leaked,) = engine.allocator.alloc(1)
    assert any("L1: " in v and "!= 64 pages" in v for v in check_engine(engine).violations)
    engine.allocator.free([leaked])
    match = engine.cache.match_prefix(prompts(3, num=1)[0])
    engine.cache.lock(match.handle)
    report = check_engine(engine)
    assert not report.idle
    assert any("lock" in v for v in report.violations), report.violations
    engine.cache.unlock(match.handle)
    engine.tiers._prefetches["gone"] = next(iter(engine.tiers._prefetches.values()), None)
    assert "L3 prefetch of gone has no live request" in check_engine(engine).violations
    del engine.tiers._prefetches["gone"]
    assert assert_ok(engine)["l1_lock_pins"] == 0


def test_pd_rooms_and_zombies_are_accounted_for(tiny_llama: Path) -> None:
    prefill = LLM(str(tiny_llama), page_size=PAGE, disaggregation_mode="prefill").engine
    decode = LLM(
        str(tiny_llama), page_size=PAGE, disaggregation_mode="decode", num_kv_pages=64,
        disaggregation_decode_enable_radix_cache=True, disaggregation_decode_local_prefill="never",
    ).engine  # fmt: skip
    req = decode.add_request(list(range(1, 30)), GREEDY)
    decode.step()
    (task,) = decode.role.take_tasks()
    counts = assert_ok(decode)
    assert (counts["decode_rooms"], counts["l1_held_pages"]) == (1, 8)  # 29 tokens: 8 pages
    p_req = prefill.role.add_prefill_task(task)
    assert assert_ok(prefill)["prefill_rooms"] == 1
    while prefill.has_unfinished:
        prefill.step()
        assert_ok(prefill)
    prefill.role.collect(p_req.rid)
    assert check_engine(prefill).idle
    decode.abort(req.rid)  # the client left while the pages were being written
    counts = assert_ok(decode)
    assert (counts["zombie_rooms"], counts["requests"], counts["l1_held_pages"]) == (1, 0, 8)
    # A room without a live request (the zombie put back among the rooms) is named.
    zombie = decode.role.table.get(req.rid)
    zombie.state = RoomState.SENT
    assert any("not a live request" in v for v in check_engine(decode).violations)
    zombie.state = RoomState.ZOMBIE
    assert decode.role.release_room(req.rid)
    assert check_engine(decode).idle and assert_ok(decode)["l1_free_pages"] > 0
