"""PD handoff at the engine level (no HTTP): a prefill engine writes KV pages into a
decode engine's shared-memory pool through the real `ipc` transport. Checks the
correctness invariant, incremental transfer sizes, and that nothing leaks."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from kvstrata import LLM, SamplingParams
from kvstrata.core import FinishReason, RequestOutput
from kvstrata.disagg.transport.base import TransferError
from kvstrata.engine.engine import Engine

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PAGE = 4


def make_pair(model: Path, **decode_flags: object) -> tuple[Engine, Engine]:
    """A prefill and a decode engine; the decode rank sends every request to the prefill
    rank unless `decode_flags` choose a local prefill mode (tests/unit/test_local_prefill.py)."""
    decode_flags = {"disaggregation_decode_local_prefill": "never", **decode_flags}
    prefill = LLM(
        str(model), page_size=PAGE, disaggregation_mode="prefill", num_kv_pages=256
    ).engine
    decode = LLM(
        str(model), page_size=PAGE, disaggregation_mode="decode", num_kv_pages=256, **decode_flags
    ).engine
    return prefill, decode


def serve_pd(
    prefill: Engine, decode: Engine, prompt: list[int], params: SamplingParams = GREEDY
) -> RequestOutput:
    """Drive one request through decode-first PD to completion, both engines in-process."""
    req = decode.add_request(prompt, params)
    final: RequestOutput | None = None
    while final is None:
        for out in decode.step():
            if out.rid == req.rid and out.finished:
                final = out
        for task in decode.role.take_tasks():
            p_req = prefill.role.add_prefill_task(task)
            while prefill.has_unfinished:
                prefill.step()
            out = decode.role.complete_transfer(prefill.role.collect(p_req.rid))
            if out.finished:
                final = out
    return final


def assert_idle(engine: Engine) -> None:
    load = engine.load()
    assert not engine.has_unfinished
    assert load.num_used_pages == 0
    assert engine.cache.num_locked_pages == 0


def unified_outputs(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(model), page_size=PAGE, disable_radix_cache=True)
    return [o.output_ids for o in llm.generate(input_ids=prompts, sampling_params=GREEDY)]


@pytest.mark.parametrize(
    "decode_flags",
    [
        {},
        {"disaggregation_decode_enable_radix_cache": True},
        {
            "disaggregation_decode_enable_radix_cache": True,
            "disaggregation_decode_enable_hicache": True,
        },
        {"disaggregation_decode_enable_radix_cache": True, "overlap_schedule": "on"},
    ],
    ids=["no-decode-cache", "decode-L1", "decode-L1-L2", "decode-L1-overlap"],
)
def test_multi_turn_pd_equals_unified(tiny_llama: Path, decode_flags: dict) -> None:
    rng = random.Random(0)
    prefill, decode = make_pair(tiny_llama, **decode_flags)
    history: list[int] = []
    turns: list[RequestOutput] = []
    for _ in range(3):
        history = history + [rng.randrange(500) for _ in range(13)]
        out = serve_pd(prefill, decode, history)
        assert out.output_ids == unified_outputs(tiny_llama, [history])[0]
        turns.append(out)
        history = history + out.output_ids
    caching = bool(decode_flags)
    for k, out in enumerate(turns):
        usage = out.cache_usage
        prompt_len = len(out.prompt_ids)
        assert usage.cached_tokens + usage.transferred_tokens == prompt_len
        if caching and k > 0:
            # Only the new suffix moves, rounded to a page: the rest is the previous turn.
            previous_len = len(turns[k - 1].prompt_ids) + len(turns[k - 1].output_ids) - 1
            assert usage.transferred_tokens <= prompt_len - previous_len + PAGE
        if not caching:
            assert usage.transferred_tokens == prompt_len
    assert_idle(prefill)
    assert_idle(decode)


def test_full_hit_moves_no_pages(tiny_llama: Path) -> None:
    prefill, decode = make_pair(tiny_llama, disaggregation_decode_enable_radix_cache=True)
    prompt = list(range(40, 80))  # 40 tokens: 10 whole pages
    first = serve_pd(prefill, decode, prompt)
    again = serve_pd(prefill, decode, prompt)
    assert again.output_ids == first.output_ids
    assert again.cache_usage.transferred_tokens == 0
    assert again.cache_usage.l1_tokens == 40


def test_prefill_counts_the_pages_and_bytes_it_sent(tiny_llama: Path) -> None:
    prefill, decode = make_pair(tiny_llama, disaggregation_decode_enable_radix_cache=True)
    first = serve_pd(prefill, decode, list(range(40, 80)))  # 40 tokens: 10 pages move
    serve_pd(prefill, decode, list(range(40, 80)) + first.output_ids + [5, 6, 7])
    metrics = prefill.role.metrics()
    assert metrics["pd_sent_writes"] == 2
    # Turn 2 (40 + 10 + 3 = 53 tokens) sends only the pages past the 12 whole pages the
    # decode rank holds of turn 1 (its 49 tokens with KV: the last output has none yet).
    assert metrics["pd_sent_pages"] == 10 + 2
    assert metrics["pd_sent_bytes"] == 12 * prefill.pool.page_bytes
    assert metrics["pd_send_seconds"] > 0
    assert decode.role.metrics() == {"pd_failed_rooms": 0, "pd_zombie_rooms": 0}


def test_a_request_that_waits_too_long_for_pages_fails_alone(tiny_llama: Path) -> None:
    decode = LLM(
        str(tiny_llama), page_size=PAGE, disaggregation_mode="decode", num_kv_pages=16,
        disaggregation_decode_prealloc_timeout_s=0.2, disaggregation_decode_local_prefill="never",
    ).engine  # fmt: skip
    holder = decode.add_request(list(range(40)), GREEDY)  # 10 of the 16 pages, as a room
    assert decode.step() == [] and len(decode.role.take_tasks()) == 1
    waiter = decode.add_request(list(range(50, 90)), GREEDY)  # needs 10: only 6 are left
    assert decode.step() == []
    time.sleep(0.3)
    (out,) = decode.step()
    assert (out.rid, out.finished, out.finish_reason) == (waiter.rid, True, FinishReason.ABORT)
    assert out.error is not None and "no KV pages" in out.error.message
    assert waiter.rid not in decode.requests and not decode.role.queue
    assert holder.rid in decode.role.rooms  # the room is untouched


def test_mismatched_handoff_fails_the_room_only(tiny_llama: Path) -> None:
    prefill, decode = make_pair(tiny_llama)
    req = decode.add_request(list(range(1, 30)), GREEDY)
    decode.step()
    (task,) = decode.role.take_tasks()
    p_req = prefill.role.add_prefill_task(task)
    while prefill.has_unfinished:
        prefill.step()
    result = prefill.role.collect(p_req.rid)
    bad = type(result)(result.room, result.first_token_id, result.num_pages_written - 1, 0)
    with pytest.raises(TransferError):
        decode.role.complete_transfer(bad)
    decode.abort(req.rid)
    assert decode.has_unfinished  # the room's pages wait until prefill cannot write
    assert decode.role.release_room(req.rid)
    assert_idle(decode)
    # The rank keeps serving.
    out = serve_pd(prefill, decode, list(range(1, 30)))
    assert out.output_ids == unified_outputs(tiny_llama, [list(range(1, 30))])[0]


def test_stale_l3_promise_still_gives_correct_output(tiny_llama: Path, tmp_path: Path) -> None:
    """L3 says a prefix exists, then its pages vanish before they are read: the decode
    rank counts only pages that actually arrived, and prefill sends the rest."""
    prefill, decode = make_pair(
        tiny_llama,
        disaggregation_decode_enable_radix_cache=True,
        disaggregation_decode_enable_hicache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path / "l3"),
        hicache_storage_prefetch_policy="wait_complete",
        hicache_prefetch_threshold=4,
        disaggregation_decode_parallel_restore=False,  # tests/unit/test_parallel_restore.py
    )
    prompt = list(range(100, 160))
    first = serve_pd(prefill, decode, prompt)
    assert decode.flush_cache()
    backend = decode.tiers.l3.backend
    real_get = backend.batch_get

    def get_after_the_pages_vanished(keys: list[bytes], host_pages: list[Any]) -> list[bool]:
        for key in keys:
            backend.path_of(key).unlink(missing_ok=True)
        return real_get(keys, host_pages)

    backend.batch_get = get_after_the_pages_vanished
    again = serve_pd(prefill, decode, prompt)
    assert again.output_ids == first.output_ids == unified_outputs(tiny_llama, [prompt])[0]
    assert again.cache_usage.l3_tokens == 0
    assert again.cache_usage.transferred_tokens == len(prompt)
    assert backend.stats().num_misses > 0
    assert_idle(decode)
