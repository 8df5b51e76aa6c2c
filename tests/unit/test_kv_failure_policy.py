"""A failed room costs a retry, not the request (`--disaggregation-kv-failure-policy`): the
decode rank's requeue of a failed room in process (a new room with new pages, or local
prefill; the old room's pages wait as a zombie; outputs equal unified; nothing leaks),
and the dispatcher's choice of path and its message with a stand-in engine loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstrata import LLM, SamplingParams
from kvstrata.core import ErrorKind, PrefillPath, RequestOutput
from kvstrata.disagg.protocol import PrefillTask
from kvstrata.disagg.rooms import Attempts, SentRoom
from kvstrata.disagg.transport.base import TransferError
from kvstrata.engine.engine import Engine
from kvstrata.engine.invariants import check_engine
from kvstrata.pd.decode_sender import DecodeRoomSender
from kvstrata.pd.failures import (
    FailurePolicy,
    PrefillRankError,
    failure_cause,
)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PAGE = 4
PROMPT = list(range(60, 110))


def engines(model: Path) -> tuple[Engine, Engine]:
    prefill = LLM(str(model), page_size=PAGE, disaggregation_mode="prefill").engine
    decode = LLM(
        str(model), page_size=PAGE, disaggregation_mode="decode", num_kv_pages=64,
        disaggregation_decode_enable_radix_cache=True,
        disaggregation_decode_local_prefill="never",
    ).engine  # fmt: skip
    return prefill, decode


def run_room(prefill: Engine, decode: Engine, task: PrefillTask) -> RequestOutput:
    p_req = prefill.role.add_prefill_task(task)
    while prefill.has_unfinished:
        prefill.step()
    return decode.role.complete_transfer(prefill.role.collect(p_req.rid))


def finish(decode: Engine, out: RequestOutput) -> RequestOutput:
    while not out.finished:
        out = next(o for o in decode.step() if o.rid == out.rid)
    return out


def unified(model: Path) -> list[int]:
    llm = LLM(str(model), page_size=PAGE, disable_radix_cache=True)
    return llm.generate(input_ids=[PROMPT], sampling_params=GREEDY)[0].output_ids


def assert_ok(engine: Engine) -> None:
    report = check_engine(engine)
    assert report.ok, report.violations


def test_a_failed_room_is_retried_in_a_new_room_with_new_pages(tiny_llama: Path) -> None:
    prefill, decode = engines(tiny_llama)
    req = decode.add_request(PROMPT, GREEDY)
    decode.step()
    (first,) = decode.role.take_tasks()
    assert first.room == req.rid
    assert decode.role.requeue_room(first.room, PrefillPath.REMOTE)
    assert first.room in decode.role.zombies and req.page_ids == []
    assert_ok(decode)
    decode.step()
    (second,) = decode.role.take_tasks()
    assert second.room == f"{req.rid}.1"
    assert not set(second.dst_page_ids) & set(first.dst_page_ids)  # a late write lands apart
    # The first room's prefill rank writes late, after the retry's pages were handed out:
    # into the zombie's pages, and its result is refused.
    with pytest.raises(TransferError, match="no room"):
        run_room(prefill, decode, first)
    out = finish(decode, run_room(prefill, decode, second))
    assert out.output_ids == unified(tiny_llama)
    assert out.cache_usage.transferred_tokens == len(PROMPT)
    assert decode.role.room_of(req.rid) is None
    assert decode.role.release_room(first.room)  # the first rank promised not to write
    assert_ok(decode)
    assert not decode.has_unfinished and decode.load().num_used_pages == 0


def test_a_failed_room_is_recomputed_on_the_decode_rank(tiny_llama: Path) -> None:
    _, decode = engines(tiny_llama)
    req = decode.add_request(PROMPT, GREEDY)
    decode.step()
    (task,) = decode.role.take_tasks()
    assert decode.role.requeue_room(task.room, PrefillPath.LOCAL)
    assert req.prefill_path is PrefillPath.LOCAL
    out = None
    while out is None:
        out = next((o for o in decode.step() if o.finished), None)
    assert out.output_ids == unified(tiny_llama)
    assert out.cache_usage.local_prefill_tokens == len(PROMPT)
    assert decode.role.release_room(task.room)
    assert_ok(decode)
    assert not decode.has_unfinished and decode.load().num_used_pages == 0
    assert decode.cache.num_locked_pages == 0


def test_an_out_of_vocabulary_first_token_fails_the_room_not_the_engine(
    tiny_llama: Path,
) -> None:
    prefill, decode = engines(tiny_llama)
    decode.add_request(PROMPT, GREEDY)
    decode.step()
    (task,) = decode.role.take_tasks()
    p_req = prefill.role.add_prefill_task(task)
    while prefill.has_unfinished:
        prefill.step()
    good = prefill.role.collect(p_req.rid)
    bad = type(good)(good.room, 10**9, good.num_pages_written, 0)
    with pytest.raises(TransferError, match="outside the vocabulary"):
        decode.role.complete_transfer(bad)
    assert decode.role.request_in(task.room) is not None  # the room still waits
    finish(decode, decode.role.complete_transfer(good))


# -- the dispatcher's choice, with a stand-in engine loop --------------------------------


class Recorder:
    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.requeued: list[tuple[str, PrefillPath]] = []
        self.failed: dict[str, str] = {}
        self.kinds: dict[str, ErrorKind] = {}
        self.released: list[str] = []
        self.next_target: str | None = None

    def requeue_room(
        self, room: str, path: PrefillPath, target: str | None = None, why: str = ""
    ) -> bool:
        self.requeued.append((room, path))
        self.next_target = target if self.accept else None
        return self.accept

    def fail_room(self, room: str, message: str, kind: ErrorKind = ErrorKind.UNAVAILABLE) -> None:
        self.failed[room] = message
        self.kinds[room] = kind

    def release_room(self, room: str) -> bool:
        self.released.append(room)
        return True


class Loop:
    def __init__(self, engine: Recorder) -> None:
        self.engine = engine

    async def run(self, command: Callable[..., Any], *args: Any) -> Any:
        return command(*args)

    async def run_output(self, command: Callable[..., Any], *args: Any) -> None:
        command(*args)


NOBODY = "http://127.0.0.1:1"  # refused at once
ALSO_NOBODY = "http://127.0.0.1:2"


def dispatch_one(mode: str, fallback: tuple[str, ...], accept: bool = True) -> Recorder:
    async def main() -> Recorder:
        engine = Recorder(accept)
        dispatcher = DecodeRoomSender(
            Loop(engine), engine, timeout_s=2, failures=FailurePolicy(mode, fallback)
        )  # type: ignore[arg-type]
        task = PrefillTask("r1", [1, 2, 3], 0, [0], {"backend": "ipc"})
        dispatcher.send([SentRoom("r1", NOBODY, task, Attempts())])
        for _ in range(200):
            if engine.released:
                break
            await asyncio.sleep(0.01)
        await dispatcher.close()
        engine.counts = dict(dispatcher.failures.counts)  # type: ignore[attr-defined]
        return engine

    return asyncio.run(main())


def test_retry_goes_to_a_rank_not_tried_then_recomputes() -> None:
    engine = dispatch_one("retry", (NOBODY, ALSO_NOBODY))
    assert engine.requeued == [("r1", PrefillPath.REMOTE)] and not engine.failed
    assert engine.next_target == ALSO_NOBODY  # type: ignore[attr-defined]
    assert engine.counts == {("unreachable", "retried"): 1}  # type: ignore[attr-defined]
    assert engine.released == ["r1"]  # the failed room's pages, once no write can come
    only_one = dispatch_one("retry", (NOBODY,))
    assert only_one.requeued == [("r1", PrefillPath.LOCAL)]
    assert only_one.counts == {("unreachable", "recomputed"): 1}  # type: ignore[attr-defined]


def test_recompute_and_fail_policies() -> None:
    recompute = dispatch_one("recompute", (ALSO_NOBODY,))
    assert recompute.requeued == [("r1", PrefillPath.LOCAL)] and not recompute.failed
    fail = dispatch_one("fail", (ALSO_NOBODY,))
    assert fail.requeued == []
    message = fail.failed["r1"]
    assert message.startswith("prefill for this request failed: ") and NOBODY in message
    assert fail.counts == {("unreachable", "failed"): 1}  # type: ignore[attr-defined]
    gone = dispatch_one("recompute", (), accept=False)  # the request ended meanwhile
    assert "r1" in gone.failed and gone.released == ["r1"]


def test_failure_causes() -> None:
    request = httpx.Request("POST", NOBODY)
    assert failure_cause(httpx.ConnectError("refused", request=request)) == "unreachable"
    assert failure_cause(httpx.ConnectTimeout("slow", request=request)) == "unreachable"
    assert failure_cause(httpx.ReadTimeout("frozen", request=request)) == "timeout"
    assert failure_cause(httpx.RemoteProtocolError("died", request=request)) == "unreachable"
    assert failure_cause(PrefillRankError(NOBODY, 502, "write failed")) == "transfer"
    assert failure_cause(PrefillRankError(NOBODY, 503, "stopping")) == "prefill_error"
    assert failure_cause(ValueError("not a result")) == "mismatch"
    # The request's own error on the prefill rank: neither retried nor recomputed.
    poison = PrefillRankError(NOBODY, 500, "{}", code="engine_failed")
    assert failure_cause(poison) == "request_error"
    policy = FailurePolicy("retry", (ALSO_NOBODY,))
    assert policy.next_url(Attempts([NOBODY], ["x"]), "request_error") is None
    assert not policy.may_recompute("request_error") and policy.may_recompute("unreachable")
