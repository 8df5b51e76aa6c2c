"""PD between tensor-parallel ranks on the CPU (issue 32): a TP 2 prefill rank's workers
each write their head slice into the matching worker of a TP 2 decode rank (ipc over
shared-memory pools, and the Mooncake Transfer Engine over tcp), and the decode rank's
answers equal one unified TP 2 rank's in fp32 (tokens and their logprobs), over multi-turn
conversations through the decode rank's L1 and L2. Ranks of different TP sizes, and
endpoints whose slices do not add up, are refused naming both sizes; a follower's write
that fails fails its room alone, and every page and pin is given back."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstrata import LLM, SamplingParams
from kvstrata.disagg.transport.base import TransferError
from kvstrata.disagg.wire import TaskRefused, parse_task
from kvstrata.engine.engine import Engine
from kvstrata.engine.invariants import check_engine
from kvstrata.pd.prefill_endpoints import _task_limits

sys.path.insert(0, str(Path(__file__).parent))
from mooncake_fixtures import require_mooncake
from test_fp8_kv_scales import P2P
from test_pd_engine import PAGE, assert_idle, serve_pd
from test_tp import assert_same

SAMPLING = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
FLAGS: dict[str, Any] = {"page_size": PAGE, "dtype": "float32", "tp_size": 2}
DECODE_CACHE = {
    "num_kv_pages": 32,  # a few conversations: second turns find pages in L2 too
    "disaggregation_decode_enable_radix_cache": True,
    "disaggregation_decode_enable_hicache": True,
    "hicache_ratio": 4,
}


def conversations(seed: int) -> list[list[int]]:
    """Six first turns, then each one's second turn (the first's prompt and 6 more)."""
    rng = random.Random(seed)
    firsts = [[rng.randrange(1, 500) for _ in range(rng.randint(9, 40))] for _ in range(6)]
    return firsts + [p + [rng.randrange(1, 500) for _ in range(6)] for p in firsts]


def pd_pair(
    model: Path, transport: str, flags: dict[str, Any] = FLAGS, **decode_flags: Any
) -> tuple[Engine, Engine]:
    """A prefill and a decode rank of `flags` (TP 2) over `transport`."""
    backend: dict[str, Any] = {}
    if transport == "mooncake":
        require_mooncake()
        backend = {
            "disaggregation_transfer_backend": "mooncake",
            "disaggregation_mooncake_config": P2P,
        }
    prefill = LLM(
        str(model), num_kv_pages=128, disaggregation_mode="prefill", **flags, **backend
    ).engine
    decode = LLM(
        str(model),
        disaggregation_mode="decode",
        disaggregation_decode_local_prefill="never",
        **flags,
        **backend,
        **({"num_kv_pages": 128} | decode_flags),
    ).engine
    return prefill, decode


@pytest.fixture(scope="module")
def unified(tiny_qwen3: Path) -> Iterator[Engine]:
    with LLM(str(tiny_qwen3), num_kv_pages=128, **FLAGS) as llm:
        yield llm.engine


def answers(engine: Engine, prompts: list[list[int]]) -> list[Any]:
    outs = []
    for prompt in prompts:  # one at a time, as the PD pair serves them
        req = engine.add_request(prompt, SAMPLING)
        while not (done := [o for o in engine.step() if o.rid == req.rid and o.finished]):
            pass
        outs.append(done[0])
    return outs


@pytest.mark.parametrize("transport", ["ipc", "mooncake"])
def test_pd_tp2_to_tp2_equals_the_unified_tp2_rank(
    tiny_qwen3: Path, unified: Engine, transport: str
) -> None:
    prompts = conversations(32)
    want = answers(unified, prompts)
    prefill, decode = pd_pair(tiny_qwen3, transport, **DECODE_CACHE)
    try:
        got = [serve_pd(prefill, decode, prompt, SAMPLING) for prompt in prompts]
        assert_same(want, got, "logprobs")
        # Second turns moved only their new pages: the rest came from the decode tiers.
        assert sum(o.cache_usage.cached_tokens for o in got[6:]) > 0
        assert decode.tiers.metrics()["hicache_hit_tokens_l2"] > 0
        sent = prefill.role.metrics()
        assert sent["pd_sent_bytes"] == sent["pd_sent_pages"] * 2 * prefill.pool.page_bytes
        for engine in (prefill, decode):
            assert check_engine(engine).violations == []
    finally:
        prefill.close()
        decode.close()


def test_tp_sizes_that_differ_are_refused_naming_both(tiny_qwen3: Path) -> None:
    one = LLM(str(tiny_qwen3), page_size=PAGE, num_kv_pages=64, disaggregation_mode="decode")
    prefill, decode = pd_pair(tiny_qwen3, "ipc")
    try:
        for engine in (one.engine, decode):
            engine.add_request(list(range(1, 20)), SAMPLING)
            engine.step()
        (task_tp1,) = one.engine.role.take_tasks()  # type: ignore[attr-defined]
        (task_tp2,) = decode.role.take_tasks()  # type: ignore[attr-defined]
        # A TP 2 prefill rank and a TP 1 decode rank, and the other way round.
        with pytest.raises(
            TaskRefused, match=r"decode rank runs --tp-size 1, this prefill rank --tp-size 2"
        ):
            _task_limits(prefill).check(parse_task(_json(task_tp1.to_json())))
        tp1_prefill = LLM(
            str(tiny_qwen3), page_size=PAGE, num_kv_pages=64, disaggregation_mode="prefill"
        )
        with pytest.raises(
            TaskRefused, match=r"decode rank runs --tp-size 2, this prefill rank --tp-size 1"
        ):
            _task_limits(tp1_prefill.engine).check(parse_task(_json(task_tp2.to_json())))
        tp1_prefill.close()
        # Slices that do not add up to the size the endpoint claims.
        forged = task_tp2.to_json()
        forged["decode_endpoint"] = forged["decode_endpoint"] | {"tp_slices": []}
        with pytest.raises(TaskRefused, match="0 tp_slices for a decode rank of 2 workers"):
            _task_limits(prefill).check(parse_task(_json(forged)))
    finally:
        one.close()
        prefill.close()
        decode.close()


def test_a_follower_write_that_fails_fails_its_room_alone(
    tiny_qwen3: Path, unified: Engine
) -> None:
    """The decode follower's pool file named in the task is not the one the prefill
    follower finds: its write is refused there, the room fails once the leader's slice
    settled too, and both ranks give every page back and go on serving."""
    prefill, decode = pd_pair(tiny_qwen3, "ipc")
    try:
        req = decode.add_request(list(range(1, 30)), SAMPLING)
        decode.step()
        (task,) = decode.role.take_tasks()  # type: ignore[attr-defined]
        endpoint = dict(task.decode_endpoint)
        (follower,) = endpoint["tp_slices"]
        endpoint["tp_slices"] = [follower | {"owner": "0" * 32}]
        bad = type(task)(**{**task.__dict__, "decode_endpoint": endpoint})
        p_req = prefill.role.add_prefill_task(bad)  # type: ignore[attr-defined]
        while prefill.has_unfinished:
            prefill.step()
        with pytest.raises(TransferError):
            prefill.role.collect(p_req.rid)  # type: ignore[attr-defined]
        assert_idle(prefill)
        decode.role.fail_room(task.room, "the transfer failed")  # type: ignore[attr-defined]
        decode.step()
        assert decode.role.release_room(task.room)  # type: ignore[attr-defined]
        assert req.rid not in decode.requests
        assert_idle(decode)
        prompt = list(range(1, 30))
        assert (
            serve_pd(prefill, decode, prompt, SAMPLING).output_ids
            == answers(unified, [prompt])[0].output_ids
        )
        for engine in (prefill, decode):
            assert check_engine(engine).violations == []
    finally:
        prefill.close()
        decode.close()


def _json(data: dict[str, Any]) -> str:
    import json

    return json.dumps(data)
