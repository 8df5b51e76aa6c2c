"""Streamed writes (issue 17.2): a prefill rank starts writing each prefill chunk's pages as
soon as the chunk is computed. In process, the real `ipc` transport: streamed rooms equal
whole-room writes page for page and give the unified output; a request whose pages are
being read is never preempted; a failed chunk write fails its room once its other writes
settle, and an abort mid-stream keeps the pages until then."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from test_pd_async_write import GatedSender, gated_prefill

from kvstrata import LLM, SamplingParams
from kvstrata.config import EngineConfig
from kvstrata.disagg.factory import streams_writes
from kvstrata.disagg.prefill import PrefillHandoff
from kvstrata.disagg.transport.base import KVSender, PendingWrite
from kvstrata.engine.engine import Engine
from kvstrata.engine.invariants import check_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PAGE = 4


def pair(model: Path, **prefill_flags: Any) -> tuple[Engine, Engine]:
    prefill = LLM(
        str(model), page_size=PAGE, disaggregation_mode="prefill",
        **{"num_kv_pages": 256, "max_num_batched_tokens": 12, **prefill_flags},
    ).engine  # fmt: skip
    decode = LLM(
        str(model), page_size=PAGE, disaggregation_mode="decode", num_kv_pages=256,
        disaggregation_decode_local_prefill="never",
    ).engine  # fmt: skip
    return prefill, decode


class CountingSender(KVSender):
    """The real sender, counting the writes started through it."""

    def __init__(self, inner: KVSender) -> None:
        super().__init__(inner.pool)
        self.inner = inner
        self.num_pages_per_write: list[int] = []

    def write(self, endpoint: dict[str, Any], src: list[int], dst: list[int]) -> None:
        self.inner.write(endpoint, src, dst)

    def start(self, endpoint: dict[str, Any], src: list[int], dst: list[int]) -> PendingWrite:
        self.num_pages_per_write.append(len(src))
        return self.inner.start(endpoint, src, dst)


class WriteOrder(CountingSender):
    """Counts the writes and, for each, how many forwards the engine ran before it."""

    def __init__(self, inner: KVSender, engine: Engine) -> None:
        super().__init__(inner)
        self.forwards_before_write: list[int] = []
        self.num_forwards = 0
        run = engine.runner.run

        def counted_run(batch: Any) -> torch.Tensor:
            self.num_forwards += 1
            return run(batch)

        engine.runner.run = counted_run  # type: ignore[method-assign]

    def start(self, endpoint: dict[str, Any], src: list[int], dst: list[int]) -> PendingWrite:
        self.forwards_before_write.append(self.num_forwards)
        return super().start(endpoint, src, dst)


def serve(prefill: Engine, decode: Engine, prompt: list[int]) -> tuple[list[int], list[int]]:
    """One request through PD: its output ids and the decode pool pages it received."""
    req = decode.add_request(prompt, GREEDY)
    decode.step()
    (task,) = decode.role.take_tasks()
    p_req = prefill.role.add_prefill_task(task)
    while prefill.has_unfinished:
        prefill.step()
    out = decode.role.complete_transfer(prefill.role.collect(p_req.rid))
    pages = list(req.page_ids)
    received = decode.pool.data[:, :, pages].clone()
    while not out.finished:
        out = next(o for o in decode.step() if o.rid == req.rid)
    return out.output_ids, received  # type: ignore[return-value]


def test_streamed_rooms_equal_whole_room_writes(tiny_llama: Path) -> None:
    prompt = [random.Random(1).randrange(500) for _ in range(50)]  # 13 pages, 5 chunks
    outputs, received = {}, {}
    for stream in (True, False):
        prefill, decode = pair(tiny_llama, stream_writes="on" if stream else "off")
        handoff = prefill.role
        assert isinstance(handoff, PrefillHandoff)
        counting = CountingSender(handoff.sender)
        handoff.sender = counting
        outputs[stream], received[stream] = serve(prefill, decode, prompt)
        if stream:  # a write per chunk of 12 tokens (3 pages), then the last partial page
            assert len(counting.num_pages_per_write) > 1, counting.num_pages_per_write
        else:
            assert counting.num_pages_per_write == [13]
        assert sum(counting.num_pages_per_write) == 13
        assert handoff.metrics()["pd_sent_pages"] == 13
        for engine in (prefill, decode):
            report = check_engine(engine)
            assert report.ok, report.violations
    assert (
        outputs[True]
        == outputs[False]
        == (
            LLM(str(tiny_llama), page_size=PAGE, disable_radix_cache=True)
            .generate(input_ids=[prompt], sampling_params=GREEDY)[0]
            .output_ids
        )
    )
    assert torch.equal(received[True], received[False])


def test_a_cached_prefix_is_written_while_its_suffix_is_computed(tiny_llama: Path) -> None:
    """The second turn of a conversation finds its first turn's pages cached on the prefill
    rank: their write starts before the forward of the suffix's first chunk (and the room
    still lands the same pages and output as a whole-room write)."""
    rng = random.Random(3)
    first = [rng.randrange(500) for _ in range(40)]  # 10 pages
    second = first + [rng.randrange(500) for _ in range(30)]  # 17 full pages + 2 tokens
    outputs, received = {}, {}
    for stream in (True, False):
        prefill, decode = pair(tiny_llama, stream_writes="on" if stream else "off")
        serve(prefill, decode, first)  # the decode rank caches nothing (its default)
        handoff = prefill.role
        assert isinstance(handoff, PrefillHandoff)
        counting = WriteOrder(handoff.sender, prefill)
        handoff.sender = counting
        outputs[stream], received[stream] = serve(prefill, decode, second)
        assert sum(counting.num_pages_per_write) == 18
        if stream:  # the 10 cached pages first, before any forward of the suffix
            assert counting.num_pages_per_write[0] == 10, counting.num_pages_per_write
            assert counting.forwards_before_write[0] == 0, counting.forwards_before_write
        else:
            assert counting.num_pages_per_write == [18]
        for engine in (prefill, decode):
            report = check_engine(engine)
            assert report.ok, report.violations
    assert outputs[True] == outputs[False]
    assert torch.equal(received[True], received[False])


def test_a_request_whose_pages_are_read_is_not_preempted(tiny_llama: Path) -> None:
    """Two long prompts in a prefill pool too small for both: while the first one's chunk
    writes wait (the gate is shut), it is pinned and the second waits instead of taking
    its pages; once the writes land, both complete."""
    prefill, decode = pair(tiny_llama, num_kv_pages=24)
    _, gate = gated_prefill(prefill)
    rng = random.Random(2)
    prompts = [[rng.randrange(500) for _ in range(60)] for _ in range(2)]  # 15 pages each
    reqs = [decode.add_request(p, GREEDY) for p in prompts]
    decode.step()
    tasks = decode.role.take_tasks()
    p_reqs = [prefill.role.add_prefill_task(t) for t in tasks]
    for _ in range(10):  # 30 pages wanted, 24 there: without pins one would be preempted
        before = {r.rid: (prefill.kv.is_pinned(r), r.num_preemptions) for r in p_reqs}
        prefill.step()
        for r in p_reqs:
            was_pinned, num_preemptions = before[r.rid]
            assert not was_pinned or r.num_preemptions == num_preemptions
    assert all(prefill.kv.is_pinned(r) for r in p_reqs)
    assert sum(len(r.page_ids) for r in p_reqs) <= 24 < 30
    gate.open = True
    while prefill.has_unfinished:
        prefill.step()
    finals = {}
    for r in p_reqs:
        out = decode.role.complete_transfer(prefill.role.collect(r.rid))
        finals[out.rid] = out
    while decode.has_unfinished:
        finals |= {o.rid: o for o in decode.step() if o.finished}
    unified = LLM(str(tiny_llama), page_size=PAGE, disable_radix_cache=True)
    want = unified.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [finals[r.rid].output_ids for r in reqs] == [w.output_ids for w in want]
    assert check_engine(prefill).ok and not prefill.has_unfinished
    assert prefill.load().num_used_pages == 0


def test_a_failed_chunk_write_fails_the_room_after_the_rest_settles(tiny_llama: Path) -> None:
    prefill, decode = pair(tiny_llama)
    handoff, gate = gated_prefill(prefill)
    decode.add_request(list(range(100, 150)), GREEDY)
    decode.step()
    (task,) = decode.role.take_tasks()
    p_req = prefill.role.add_prefill_task(task)
    prefill.step()
    prefill.step()  # a chunk computed: its write started (gated)
    assert handoff.rooms[p_req.rid].writes
    gate.failure = "the decode rank went away"
    while prefill.has_unfinished:
        prefill.step()
    settled = handoff.settled(p_req.rid)
    assert settled.done()
    try:
        prefill.role.collect(p_req.rid)
        raise AssertionError("the room should have failed")
    except Exception as e:  # TransferError
        assert "went away" in str(e)
    assert check_engine(prefill).ok and prefill.load().num_used_pages == 0


def test_an_abort_mid_stream_keeps_the_pages_until_the_writes_settle(tiny_llama: Path) -> None:
    prefill, decode = pair(tiny_llama)
    handoff, gate = gated_prefill(prefill)
    decode.add_request(list(range(200, 250)), GREEDY)
    decode.step()
    (task,) = decode.role.take_tasks()
    p_req = prefill.role.add_prefill_task(task)
    prefill.step()
    prefill.step()
    assert handoff.rooms[p_req.rid].writes
    prefill.abort(p_req.rid)
    settled = handoff.write_settled(task.room)
    assert not settled.done() and prefill.load().num_used_pages > 0  # the writes read them
    gate.open = True
    prefill.step()
    assert settled.done() and prefill.load().num_used_pages == 0
    assert isinstance(gate, GatedSender) and check_engine(prefill).ok


@pytest.mark.parametrize(
    ("flags", "on_cuda", "on_cpu"),
    [
        ({}, True, True),  # ipc
        ({"disaggregation_transfer_backend": "mooncake"}, True, True),  # tcp: host staging
        ({"disaggregation_transfer_backend": "mooncake",
          "disaggregation_mooncake_config": '{"host_staging": "off"}'}, False, True),
        ({"disaggregation_transfer_backend": "mooncake",
          "disaggregation_mooncake_config": '{"protocol": "rdma"}'}, False, True),
        ({"disaggregation_transfer_backend": "mooncake", "stream_writes": "on",
          "disaggregation_mooncake_config": '{"host_staging": "off"}'}, True, True),
        ({"stream_writes": "off"}, False, False),
    ],
)  # fmt: skip
def test_stream_writes_auto_is_on_unless_mooncake_copies_gpu_memory(
    tiny_llama: Path, flags: dict[str, str], on_cuda: bool, on_cpu: bool
) -> None:
    config = EngineConfig.from_flags(model=str(tiny_llama), disaggregation_mode="prefill", **flags)
    assert streams_writes(config, pool_on_cuda=True) is on_cuda
    assert streams_writes(config, pool_on_cuda=False) is on_cpu
