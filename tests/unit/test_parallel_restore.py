"""L3 restores beside the PD transfer (decode rank): a task claims the prefix pages L3
holds while they are still being read, and every order of events ends with the unified
rank's tokens and nothing leaked: L3 first, transfer first, claimed pages that never
come (gone or corrupt, before or after the transfer landed; past the prefetch deadline),
an abort in between (before and after the transfer), a flush in between; and the off
switch. In process, the real `ipc` transport and the real `file` L3 backend, whose reads
a gate holds back so that the test chooses the order."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstrata import LLM, SamplingParams
from kvstrata.core import RequestOutput
from kvstrata.disagg.decode import DecodeHandoff
from kvstrata.disagg.protocol import PrefillTask
from kvstrata.disagg.restore import ParallelRestore
from kvstrata.engine.engine import Engine
from kvstrata.engine.invariants import check_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PAGE = 4
TURN1 = list(range(100, 140))  # 10 pages; with its outputs the decode rank holds 11


class GatedReads:
    """Holds every L3 read of `engine` back (after L3 answered what it holds, before any
    bytes move) until `open()`."""

    def __init__(self, engine: Engine) -> None:
        self.backend = engine.tiers.l3.backend
        self.gate = threading.Event()
        real_get = self.backend.batch_get

        def gated_get(keys: list[bytes], host_pages: list[Any]) -> list[bool]:
            self.gate.wait()
            return real_get(keys, host_pages)

        self.backend.batch_get = gated_get

    def open(self) -> None:
        self.gate.set()

    def page_path(self, engine: Engine, rid: str, page: int) -> Path:
        req = engine.requests[rid]
        return self.backend.path_of(engine.kv.hashes(req)(page + 1)[page])


def make_pair(model: Path, l3_dir: Path, **decode_flags: object) -> tuple[Engine, Engine]:
    prefill = LLM(
        str(model), page_size=PAGE, disaggregation_mode="prefill", num_kv_pages=256
    ).engine
    decode = LLM(
        str(model), page_size=PAGE, disaggregation_mode="decode", num_kv_pages=256,
        disaggregation_decode_enable_radix_cache=True, disaggregation_decode_enable_hicache=True,
        disaggregation_decode_local_prefill="never", hicache_storage_backend="file",
        hicache_storage_dir=str(l3_dir), hicache_prefetch_threshold=PAGE,
        **{"hicache_storage_prefetch_policy": "wait_complete", **decode_flags},
    ).engine  # fmt: skip
    return prefill, decode


def prefill_room(prefill: Engine, task: PrefillTask) -> Any:
    p_req = prefill.role.add_prefill_task(task)
    while prefill.has_unfinished:
        prefill.step()
    return prefill.role.collect(p_req.rid)


def finish(prefill: Engine, decode: Engine) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    while decode.has_unfinished:
        finals |= {out.rid: out for out in decode.step() if out.finished}
        for task in decode.role.take_tasks():
            out = decode.role.complete_transfer(prefill_room(prefill, task))
            if out.finished:
                finals[out.rid] = out
    decode.tiers.wait_io()
    decode.tiers.poll()
    return finals


def unified(model: Path, prompt: list[int]) -> list[int]:
    llm = LLM(str(model), page_size=PAGE, disable_radix_cache=True)
    return llm.generate(input_ids=[prompt], sampling_params=GREEDY)[0].output_ids


def assert_idle(engine: Engine) -> None:
    report = check_engine(engine)
    assert report.ok, report.violations
    assert not engine.has_unfinished
    assert engine.load().num_used_pages == 0 and engine.cache.num_locked_pages == 0


def restores(decode: Engine) -> ParallelRestore:
    handoff = decode.role
    assert isinstance(handoff, DecodeHandoff) and isinstance(handoff.restores, ParallelRestore)
    return handoff.restores


def wait_until(condition: Any) -> None:
    for _ in range(20_000):  # behaviour, not timing: a worker thread moves it along
        if condition():
            return
        time.sleep(0.001)
    raise AssertionError("condition never held")


class Turn2:
    """Turn 1 served and only in L3 (the decode rank flushed L1 and L2); turn 2's task
    is out, claiming turn 1's 11 pages while the gate holds their read back."""

    def __init__(self, model: Path, l3_dir: Path, **flags: object) -> None:
        self.model = model
        self.prefill, self.decode = make_pair(model, l3_dir, **flags)
        self.decode.add_request(TURN1, GREEDY)
        (first,) = finish(self.prefill, self.decode).values()
        assert self.decode.flush_cache()
        self.gate = GatedReads(self.decode)
        self.prompt = TURN1 + first.output_ids + list(range(7, 20))
        self.req = self.decode.add_request(self.prompt, GREEDY)
        self.task = self.wait_for_task()

    def wait_for_task(self) -> PrefillTask:
        tasks: list[PrefillTask] = []

        def stepped() -> bool:
            self.decode.step()
            tasks.extend(self.decode.role.take_tasks())
            return bool(tasks)

        wait_until(stepped)
        return tasks[0]

    def transfer(self) -> RequestOutput:
        return self.decode.role.complete_transfer(prefill_room(self.prefill, self.task))

    def settle_read(self) -> None:
        """Open the gate and step until the claimed span settled."""
        self.gate.open()
        wait_until(lambda: not self.decode.step() and not restores(self.decode)._pending)

    def page_path(self, page: int) -> Path:
        return self.gate.page_path(self.decode, self.req.rid, page)

    def expected(self) -> list[int]:
        return unified(self.model, self.prompt)


@pytest.fixture
def turn2(tiny_llama: Path, tmp_path: Path) -> Iterator[Turn2]:
    setup = Turn2(tiny_llama, tmp_path / "l3")
    yield setup
    setup.gate.open()


def test_the_task_claims_the_pages_still_being_read(turn2: Turn2) -> None:
    assert turn2.task.prefix_len == 44  # turn 1's 11 pages, none of them arrived yet
    assert turn2.req.num_computed_tokens == 0
    assert restores(turn2.decode).is_pending(turn2.task.room)


def test_l3_first_then_the_transfer(turn2: Turn2) -> None:
    turn2.settle_read()
    assert turn2.req.num_computed_tokens == 44  # restored while the room is still out
    assert turn2.decode.role.request_in(turn2.task.room) is turn2.req
    first = turn2.transfer()
    assert len(first.new_token_ids) == 1
    (final,) = finish(turn2.prefill, turn2.decode).values()
    assert final.output_ids == turn2.expected()
    usage = final.cache_usage
    assert (usage.l3_tokens, usage.transferred_tokens) == (44, len(turn2.prompt) - 44)
    assert restores(turn2.decode).metrics()["pd_parallel_restore_pages"] == 11
    assert_idle(turn2.decode)


def test_transfer_first_sends_the_first_token_then_waits_for_l3(turn2: Turn2) -> None:
    first = turn2.transfer()
    assert first.new_token_ids and not first.finished  # the first token goes out now
    assert turn2.task.room in turn2.decode.role.restoring
    assert not turn2.decode.step()  # no decode step may read pages still on the way
    turn2.gate.open()
    (final,) = finish(turn2.prefill, turn2.decode).values()
    assert final.output_ids == turn2.expected()
    assert final.output_ids[0] == first.new_token_ids[0]
    assert final.cache_usage.l3_tokens == 44
    assert restores(turn2.decode).metrics()["pd_restore_repairs"] == 0
    assert_idle(turn2.decode)


@pytest.mark.parametrize("damage", ["gone", "corrupt"])
def test_a_page_failing_after_the_transfer_landed_is_recomputed(turn2: Turn2, damage: str) -> None:
    first = turn2.transfer()
    path = turn2.page_path(6)
    if damage == "gone":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    turn2.gate.open()
    (final,) = finish(turn2.prefill, turn2.decode).values()
    assert final.output_ids == turn2.expected()  # the first token kept, the rest equal
    assert final.output_ids[0] == first.new_token_ids[0]
    metrics = restores(turn2.decode).metrics()
    assert metrics["pd_restore_repairs"] == 1
    assert metrics["pd_parallel_restore_missing_pages"] == 11 - 6
    assert metrics["pd_restore_repaired_tokens"] == len(turn2.prompt) - 6 * PAGE
    assert final.cache_usage.l3_tokens == 6 * PAGE
    assert_idle(turn2.decode)


def test_a_page_failing_before_the_transfer_landed_is_recomputed(turn2: Turn2) -> None:
    turn2.page_path(0).unlink()  # the first claimed page: nothing of the span arrives
    turn2.settle_read()
    assert turn2.req.num_computed_tokens == 0
    turn2.transfer()
    assert turn2.task.room not in turn2.decode.role.restoring
    (final,) = finish(turn2.prefill, turn2.decode).values()
    assert final.output_ids == turn2.expected()
    assert restores(turn2.decode).metrics()["pd_restore_repairs"] == 1
    assert_idle(turn2.decode)


def test_a_read_past_its_deadline_is_repaired_and_still_lands_in_l2(
    tiny_llama: Path, tmp_path: Path
) -> None:
    setup = Turn2(
        tiny_llama, tmp_path / "l3", hicache_storage_prefetch_policy="timeout",
        hicache_prefetch_timeout_base_s=3600.0,
    )  # fmt: skip
    try:
        setup.transfer()
        restores(setup.decode).clock = lambda: time.monotonic() + 7200.0
        setup.decode.step()  # the deadline passed: the request stops waiting
        assert restores(setup.decode).metrics()["pd_parallel_restore_timeouts"] == 1
        setup.gate.open()
        (final,) = finish(setup.prefill, setup.decode).values()
        assert final.output_ids == setup.expected()
        assert restores(setup.decode).metrics()["pd_restore_repairs"] == 1
        assert_idle(setup.decode)
    finally:
        setup.gate.open()


@pytest.mark.parametrize("when", ["before_transfer", "after_transfer"])
def test_an_abort_in_between_leaks_nothing(turn2: Turn2, when: str) -> None:
    decode, room = turn2.decode, turn2.task.room
    if when == "after_transfer":
        turn2.transfer()
    decode.abort(turn2.req.rid)
    if when == "before_transfer":
        # The prefill rank may still write into the room's pages: a zombie until released.
        assert room in decode.role.zombies
        assert decode.role.release_room(room)
    assert not restores(decode).is_pending(room)
    turn2.gate.open()
    decode.tiers.wait_io()
    decode.step()  # collects the read: its pages land in L2 for later requests
    assert_idle(decode)
    again = decode.add_request(turn2.prompt, GREEDY)
    (final,) = finish(turn2.prefill, decode).values()
    assert final.output_ids == turn2.expected()
    assert again.num_cached_tokens == 44  # turn 1's pages, now from L2
    assert_idle(decode)


def test_a_flush_in_between_is_refused_and_l3_cleared_meanwhile_is_repaired(
    turn2: Turn2,
) -> None:
    assert not turn2.decode.flush_cache()  # a restore is in flight: refused
    turn2.transfer()
    assert not turn2.decode.flush_cache()
    for page in range(11):  # another rank clears the shared L3
        turn2.page_path(page).unlink()
    turn2.gate.open()
    (final,) = finish(turn2.prefill, turn2.decode).values()
    assert final.output_ids == turn2.expected()
    assert restores(turn2.decode).metrics()["pd_restore_repairs"] == 1
    assert turn2.decode.flush_cache()
    assert_idle(turn2.decode)


def test_the_off_switch_waits_for_the_read(tiny_llama: Path, tmp_path: Path) -> None:
    prefill, decode = make_pair(
        tiny_llama, tmp_path / "l3", disaggregation_decode_parallel_restore=False
    )
    decode.add_request(TURN1, GREEDY)
    (first,) = finish(prefill, decode).values()
    assert decode.flush_cache()
    gate = GatedReads(decode)
    prompt = TURN1 + first.output_ids + list(range(7, 20))
    decode.add_request(prompt, GREEDY)
    for _ in range(20):
        decode.step()
        assert not decode.role.take_tasks()  # waits for the read, as the policy says
    gate.open()
    (final,) = finish(prefill, decode).values()
    assert final.output_ids == unified(tiny_llama, prompt)
    assert final.cache_usage.l3_tokens == 44
    assert "pd_parallel_restores" not in decode.role.metrics()
    assert_idle(decode)
