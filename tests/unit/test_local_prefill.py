"""Local prefill on the decode rank (conditional disaggregation), in process with the real
`ipc` transport: outputs equal unified for `threshold` and `auto`, both paths in flight
together, a match that shrinks after the decision, preemption and abort mid-prefill (no
leaked pages, locks or rooms), the cost model's decisions by hand, and bad flags."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvstrata import LLM, SamplingParams
from kvstrata.config import ConfigError, EngineConfig
from kvstrata.core import PrefillPath, RequestOutput
from kvstrata.disagg.local_prefill import AutoLocal, ThresholdLocal
from kvstrata.disagg.prefill_costs import CostDefaults, LinearFit, PathCosts, PrefillDemand
from kvstrata.disagg.tpot_budget import TpotBudget
from kvstrata.engine.engine import Engine
from kvstrata.engine.invariants import check_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PAGE = 4


def make_pair(model: Path, **decode_flags: object) -> tuple[Engine, Engine]:
    prefill = LLM(
        str(model), page_size=PAGE, disaggregation_mode="prefill", num_kv_pages=256
    ).engine
    decode = LLM(
        str(model), page_size=PAGE, disaggregation_mode="decode",
        **{"num_kv_pages": 256, **decode_flags},
    ).engine  # fmt: skip
    return prefill, decode


def drive(prefill: Engine, decode: Engine) -> dict[str, RequestOutput]:
    """Step both engines until the decode rank is idle; the final output of each request."""
    finals: dict[str, RequestOutput] = {}
    while decode.has_unfinished:
        finals |= {out.rid: out for out in decode.step() if out.finished}
        for task in decode.role.take_tasks():
            p_req = prefill.role.add_prefill_task(task)
            while prefill.has_unfinished:
                prefill.step()
            out = decode.role.complete_transfer(prefill.role.collect(p_req.rid))
            if out.finished:
                finals[out.rid] = out
    return finals


def unified(
    model: Path, prompts: list[list[int]], params: SamplingParams = GREEDY
) -> list[list[int]]:
    llm = LLM(str(model), page_size=PAGE, disable_radix_cache=True)
    return [o.output_ids for o in llm.generate(input_ids=prompts, sampling_params=params)]


def assert_idle(engine: Engine) -> None:
    report = check_engine(engine)
    assert report.ok, report.violations
    assert not engine.has_unfinished
    assert engine.load().num_used_pages == 0 and engine.cache.num_locked_pages == 0


CACHE = {"disaggregation_decode_enable_radix_cache": True}
HICACHE = CACHE | {"disaggregation_decode_enable_hicache": True}


@pytest.mark.parametrize(
    "flags",
    [
        {"disaggregation_decode_local_prefill": "threshold"} | CACHE,
        {"disaggregation_decode_local_prefill": "threshold"} | HICACHE,
        {"disaggregation_decode_local_prefill": "auto"} | HICACHE,
        {"disaggregation_decode_local_prefill": "auto"},
        {
            "disaggregation_decode_local_prefill": "threshold",
            "disaggregation_decode_local_prefill_max_tokens": 12,
            "disaggregation_decode_local_prefill_chunk_tokens": 5,
        }
        | CACHE,
    ],
    ids=["threshold-L1", "threshold-L1-L2", "auto-L1-L2", "auto-no-cache", "threshold-small"],
)
def test_multi_turn_equals_unified(tiny_llama: Path, flags: dict) -> None:
    rng = random.Random(1)
    prefill, decode = make_pair(tiny_llama, **flags)
    history: list[int] = []
    for turn in range(4):
        history = history + [rng.randrange(500) for _ in range(14 if turn else 30)]
        req = decode.add_request(history, GREEDY)
        (out,) = drive(prefill, decode).values()
        assert out.output_ids == unified(tiny_llama, [history])[0]
        usage = out.cache_usage
        assert usage.prefill_path is req.prefill_path is not None
        if usage.prefill_path is PrefillPath.LOCAL:
            assert usage.transferred_tokens == 0
            assert usage.local_prefill_tokens == len(history) - usage.cached_tokens > 0
        else:
            assert usage.local_prefill_tokens == 0
            assert usage.cached_tokens + usage.transferred_tokens == len(history)
        history = history + out.output_ids
    assert_idle(decode)
    assert_idle(prefill)


def test_threshold_picks_by_uncached_length_and_both_paths_run_together(
    tiny_llama: Path,
) -> None:
    prefill, decode = make_pair(
        tiny_llama, disaggregation_decode_local_prefill="threshold",
        disaggregation_decode_local_prefill_max_tokens=20,
        disaggregation_decode_local_prefill_chunk_tokens=8, **CACHE,
    )  # fmt: skip
    rng = random.Random(2)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (12, 40, 20, 33, 7, 21)]
    reqs = [decode.add_request(p, GREEDY) for p in prompts]
    finals = drive(prefill, decode)
    paths = [req.prefill_path for req in reqs]
    assert paths == [PrefillPath.LOCAL if len(p) <= 20 else PrefillPath.REMOTE for p in prompts]
    assert [finals[r.rid].output_ids for r in reqs] == unified(tiny_llama, prompts)
    assert_idle(decode)


def test_a_match_that_shrinks_after_the_decision_is_computed(tiny_llama: Path) -> None:
    """Decided local on a 40-token L1 hit; the hit is evicted before admission: the
    scheduler matches again and computes what is gone."""
    prefill, decode = make_pair(tiny_llama, disaggregation_decode_local_prefill="threshold",
                                **CACHE)  # fmt: skip
    first = list(range(100, 140))
    decode.add_request(first, GREEDY)
    drive(prefill, decode)
    second = first + list(range(7, 19))
    req = decode.add_request(second, GREEDY)
    decode.role.before_step()  # the decision, against the cached turn
    assert req.prefill_path is PrefillPath.LOCAL and req in decode.scheduler.waiting
    assert decode.cache.num_evictable_pages > 0
    decode.cache.evict(decode.cache.num_evictable_pages)
    (out,) = drive(prefill, decode).values()
    assert out.output_ids == unified(tiny_llama, [second])[0]
    assert out.cache_usage.cached_tokens == 0
    assert out.cache_usage.local_prefill_tokens == len(second)
    assert_idle(decode)


def test_a_decision_on_l3_pages_that_vanish_before_admission_is_computed(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """Decided local on a 60-token prefix prefetched from L3; the pages leave L2 before
    admission: the scheduler computes the whole prompt, and the output is unchanged."""
    l3 = {
        "hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path / "l3"),
        "hicache_storage_prefetch_policy": "wait_complete", "hicache_prefetch_threshold": PAGE,
    }  # fmt: skip
    prefill, decode = make_pair(
        tiny_llama, disaggregation_decode_local_prefill="threshold", **HICACHE, **l3
    )
    first = list(range(100, 160))
    decode.add_request(first, GREEDY)
    drive(prefill, decode)
    decode.tiers.wait_io()  # turn 1's pages are in L3
    assert decode.flush_cache()  # and only there
    second = first + list(range(7, 19))
    req = decode.add_request(second, GREEDY)
    while not decode.kv.prefetch_ready(req):
        decode.tiers.wait_io()
        decode.tiers.poll()
    assert decode.kv.match(req, whole_prompt=True).l3_len == 60
    decode.role.before_step()  # the decision, counting the L3 pages
    assert req.prefill_path is PrefillPath.LOCAL and req in decode.scheduler.waiting
    assert decode.tiers.host.evict(decode.tiers.host.num_cached_pages) > 0
    assert decode.kv.match(req, whole_prompt=True).prefix_len == 0
    (out,) = drive(prefill, decode).values()
    assert out.output_ids == unified(tiny_llama, [second])[0]
    assert out.cache_usage.local_prefill_tokens == len(second)
    assert_idle(decode)


def test_abort_during_a_local_prefill_leaks_nothing(tiny_llama: Path) -> None:
    prefill, decode = make_pair(
        tiny_llama, disaggregation_decode_local_prefill="threshold",
        disaggregation_decode_local_prefill_chunk_tokens=4, max_num_batched_tokens=8, **HICACHE,
    )  # fmt: skip
    req = decode.add_request(list(range(200, 260)), GREEDY)
    for _ in range(3):  # 24 of 60 prompt tokens computed (nothing decodes: 8 a step)
        assert decode.step() == []
    assert 0 < req.num_computed_tokens < req.prompt_len
    out = decode.abort(req.rid)
    assert out is not None and out.finished
    assert_idle(decode)
    # The rank keeps serving, from the pages the aborted prefill left in the cache.
    decode.add_request(list(range(200, 260)), GREEDY)
    (again,) = drive(prefill, decode).values()
    assert again.output_ids == unified(tiny_llama, [list(range(200, 260))])[0]
    assert_idle(decode)


def test_preemption_during_local_prefills_keeps_outputs(tiny_llama: Path) -> None:
    """Three local requests that grow to 14 pages each in a 24-page pool: two are
    admitted (9 pages each), outgrow it and one is preempted and recomputed; outputs stay
    those of unified."""
    prefill, decode = make_pair(
        tiny_llama, disaggregation_decode_local_prefill="threshold",
        disaggregation_decode_local_prefill_chunk_tokens=64, num_kv_pages=24, **CACHE,
    )  # fmt: skip
    rng = random.Random(3)
    prompts = [[rng.randrange(500) for _ in range(34)] for _ in range(3)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    reqs = [decode.add_request(p, params) for p in prompts]
    finals = drive(prefill, decode)
    assert decode.scheduler.num_preemptions > 0
    assert all(r.prefill_path is PrefillPath.LOCAL for r in reqs)
    assert [finals[r.rid].output_ids for r in reqs] == unified(tiny_llama, prompts, params)
    assert_idle(decode)


def test_auto_calibrates_from_steps_and_rooms(tiny_llama: Path) -> None:
    prefill, decode = make_pair(tiny_llama, disaggregation_decode_local_prefill="auto", **CACHE)
    policy = decode.role.policy
    assert isinstance(policy, AutoLocal)
    rng = random.Random(4)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (9, 70, 30, 120)]
    for prompt in prompts:
        decode.add_request(prompt, GREEDY)
        drive(prefill, decode)
    assert policy.costs.step.num_observed > 0
    metrics = decode.role.metrics()
    assert metrics["pd_cost_local_step_s"] >= 0 and metrics["pd_cost_transfer_bytes_per_s"] > 0
    assert 0 <= decode.load().max_local_prefill_tokens <= decode.max_model_len
    assert_idle(decode)


# -- the decision, by hand -------------------------------------------------------------


def costs(chunk_tokens: int = 100) -> PathCosts:
    defaults = CostDefaults(
        local_s_per_token=0.001, step_s=0.01, remote_overhead_s=0.02,
        remote_s_per_token=0.001, transfer_bytes_per_s=1000.0,
    )  # fmt: skip
    return PathCosts(defaults, kv_bytes_per_token=2, chunk_tokens=chunk_tokens, step_tokens=1000)


def test_estimate_by_hand() -> None:
    estimate = costs().estimate(PrefillDemand(250, 50, 3))
    # local: 300 tokens in ceil(300 / 100) = 3 steps of 0.01 s + 300 x 0.001 s
    assert estimate.local_ttft_s == pytest.approx(0.03 + 0.3)
    # 3 running decodes each wait 250 x 0.001 s in total
    assert estimate.decode_slowdown_s == pytest.approx(0.75)
    # remote: 0.02 s + 250 x 0.001 s + 250 x 2 bytes / 1000 bytes/s
    assert estimate.remote_ttft_s == pytest.approx(0.02 + 0.25 + 0.5)
    assert estimate.local_cost_s == pytest.approx(1.08) and not estimate.prefers_local
    # Nothing decodes: local chunks take the whole step budget (1000), one step here.
    idle = costs().estimate(PrefillDemand(250, 0, 0))
    assert idle.local_cost_s == pytest.approx(0.01 + 0.25) and idle.prefers_local
    # A prefill rank computes the whole 1000-token prompt (until rooms show its own cache
    # holds a part): 0.02 + 1000 x 0.001 + 0.5 s.
    whole = costs().estimate(PrefillDemand(250, 0, 0, 1000))
    assert whole.remote_ttft_s == pytest.approx(0.02 + 1.0 + 0.5)


def test_rooms_teach_what_the_prefill_rank_computes() -> None:
    path_costs = costs()
    for _ in range(200):  # its cache holds 3/4 of each 1000-token prompt; 0.1 s per room
        path_costs.observe_room(1000, 250, room_s=0.2, prefill_s=0.1, send_s=0.05, kv_bytes=0)
    assert path_costs.remote_computed_fraction.value == pytest.approx(0.25, rel=0.01)
    assert path_costs.remote_overhead_s.value == pytest.approx(0.05, rel=0.01)
    estimate = path_costs.estimate(PrefillDemand(100, 0, 0, 1000))
    assert estimate.remote_ttft_s == pytest.approx(0.05 + 0.1 + 100 * 2 / 1000, rel=0.02)


def test_break_even_by_hand() -> None:
    # One running decode, nothing queued, chunk 100: local(U) = 0.01 x ceil(U / 100) +
    # 0.002 U; remote(U) = 0.02 + 0.003 U. Local wins while 0.01 ceil(U/100) <= 0.02 + 0.001 U,
    # i.e. everywhere: every extra 100 tokens costs local 0.01 s and remote 0.1 s more.
    policy = AutoLocal(costs(), max_model_len=4096, budget=TpotBudget(1.0))
    assert policy.max_local_tokens(PrefillDemand(0, 0, 1)) == 4096
    # Three running decodes: local(U) = 0.01 ceil(U/100) + 0.004 U against 0.02 + 0.003 U,
    # so local wins while 0.01 ceil(U/100) + 0.001 U <= 0.02: up to U = 10.
    assert policy.max_local_tokens(PrefillDemand(0, 0, 3)) == 10
    assert policy.prefers_local(PrefillDemand(10, 0, 3))
    assert not policy.prefers_local(PrefillDemand(11, 0, 3))


def test_the_tpot_budget_sends_prompts_away_while_it_is_spent() -> None:
    """Steps on the cost line (10 ms + 1 ms per prompt token): local prompt tokens took
    2/3 of the running decodes' recent step time against a 10% budget, so local prefill
    is refused (counted) while decodes run, allowed when none does, and again once plain
    decode steps bring the share under the budget; decay keeps it a ratio."""
    now = [0.0]
    budget = TpotBudget(0.1, clock=lambda: now[0])
    policy = AutoLocal(costs(), max_model_len=4096, budget=budget)
    for _ in range(10):  # one decode and 20 prompt tokens: 10 + 20 ms
        policy.observe_step(20, 0.03, num_decodes=1)
    policy.observe_step(500, 0.51, num_decodes=0)  # prompts alone slow no decode
    assert budget.share == pytest.approx(0.2 / 0.3)
    assert not policy.prefers_local(PrefillDemand(5, 0, 1))
    assert policy.max_local_tokens(PrefillDemand(0, 0, 1)) == 0
    assert policy.prefers_local(PrefillDemand(5, 0, 0))  # nothing decodes: no TPOT to spend
    for _ in range(180):  # plain decode steps: 0.2 s of prompts in 2.1 s of steps
        policy.observe_step(0, 0.01, num_decodes=1)
    assert budget.share == pytest.approx(0.2 / 2.1)
    assert policy.prefers_local(PrefillDemand(5, 0, 1))
    now[0] = budget.half_life_s  # one half-life later both sums halved: the same share
    assert budget.share == pytest.approx(0.2 / 2.1)
    assert policy.metrics()["pd_local_prefill_tpot_refused"] == 1


def test_linear_fit_learns_a_line_and_clips_outliers() -> None:
    fit = LinearFit(intercept=0.05, slope=0.001, x_ref=100)  # a prior 10x off
    for i in range(200):
        x = float(i % 50 * 10)
        fit.observe(x, 0.005 + 0.0001 * x)
    intercept, slope = fit.coefficients
    assert intercept == pytest.approx(0.005, rel=0.05) and slope == pytest.approx(1e-4, rel=0.05)
    fit.observe(100.0, 1000.0)  # a compile or a pause: clipped to 4x the prediction
    assert fit.predict(100.0) < 0.1


def test_a_bad_spell_of_rooms_fades_once_rooms_stop() -> None:
    """Rooms that waited out a partition must not keep the rank off the remote path: one
    room moves the learned overhead by at most 15% (clipped at 4x), and while no room
    lands the excess over the prior halves every 10 s, so remote wins again and is
    measured anew."""
    now = [0.0]
    path_costs = PathCosts(
        CostDefaults(0.001, 0.01, 0.02, 0.001, 1000.0), 2, 100, 1000, clock=lambda: now[0]
    )
    # 50 tokens beside 3 decodes: local 0.01 + 0.05 + 0.15 = 0.21 s; remote 0.17 s
    demand = PrefillDemand(50, 0, 3)
    assert not path_costs.estimate(demand).prefers_local
    path_costs.observe_room(10, 10, room_s=6.0, prefill_s=0.01, send_s=0.01, kv_bytes=0)
    # clipped to 4 x 0.02 = 0.08: 0.95 x 0.02 + 0.05 x 0.08
    assert path_costs.remote_overhead_s.value == pytest.approx(0.023)
    for _ in range(60):  # a long bad spell: the overhead climbs toward the 6 s rooms took
        path_costs.observe_room(10, 10, room_s=6.0, prefill_s=0.01, send_s=0.01, kv_bytes=0)
    learned = path_costs.remote_overhead_s.value
    assert learned > 4 and path_costs.estimate(demand).prefers_local
    now[0] = 10.0  # no room for one half-life: half the excess over the 0.02 s prior counts
    remote_s = path_costs.estimate(demand).remote_ttft_s
    prefill_s = path_costs.remote_prefill.predict(50)
    assert remote_s == pytest.approx(0.02 + (learned - 0.02) / 2 + prefill_s + 50 * 2 / 1000)
    now[0] = 90.0  # nine half-lives: remote wins again
    assert not path_costs.estimate(demand).prefers_local
    assert path_costs.snapshot()["pd_cost_remote_weight"] == pytest.approx(2**-9)
    path_costs.observe_room(10, 10, room_s=6.0, prefill_s=0.01, send_s=0.01, kv_bytes=0)
    assert path_costs.remote_weight() == 1.0  # a landed room counts in full again


def test_a_better_than_prior_path_does_not_fade() -> None:
    now = [0.0]
    path_costs = PathCosts(
        CostDefaults(0.001, 0.01, 0.02, 0.001, 1000.0), 2, 100, 1000, clock=lambda: now[0]
    )
    for _ in range(100):  # a faster link than the prior said
        path_costs.observe_room(10, 10, room_s=0.03, prefill_s=0.01, send_s=0.01, kv_bytes=1 << 21)
    fast = path_costs.estimate(PrefillDemand(10, 0, 1)).remote_ttft_s
    now[0] = 1000.0
    assert path_costs.estimate(PrefillDemand(10, 0, 1)).remote_ttft_s == fast


def test_threshold_by_hand() -> None:
    policy = ThresholdLocal(64)
    assert policy.prefers_local(PrefillDemand(64, 10_000, 100))
    assert not policy.prefers_local(PrefillDemand(65, 0, 0))
    assert policy.max_local_tokens(PrefillDemand(0, 0, 0)) == 64


# -- flags ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (
            {"disaggregation_decode_local_prefill": "sometimes"},
            "--disaggregation-decode-local-prefill",
        ),
        (
            {"disaggregation_decode_local_prefill_max_tokens": -1},
            "--disaggregation-decode-local-prefill-max-tokens must be >= 0",
        ),
        (
            {"disaggregation_decode_local_prefill_max_tokens": 64},
            "--disaggregation-decode-local-prefill-max-tokens needs "
            "--disaggregation-decode-local-prefill threshold",
        ),
        (
            {"disaggregation_decode_local_prefill_chunk_tokens": 0},
            "--disaggregation-decode-local-prefill-chunk-tokens must be >= 1",
        ),
        (
            {
                "disaggregation_decode_local_prefill": "never",
                "disaggregation_decode_local_prefill_chunk_tokens": 64,
            },
            "--disaggregation-decode-local-prefill-chunk-tokens needs",
        ),
    ],
)
def test_bad_flags_name_the_flag(tiny_llama: Path, flags: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        EngineConfig.from_flags(model=str(tiny_llama), disaggregation_mode="decode", **flags)


def test_local_prefill_flags_need_decode_mode(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError, match="--disaggregation-decode-local-prefill needs "
                       "--disaggregation-mode decode"):  # fmt: skip
        EngineConfig.from_flags(model=str(tiny_llama), disaggregation_decode_local_prefill="never")
