"""W2 (batch-1 decode, qwen3-8b shapes, 2k context) with each batch-1 kernel trick turned
off in turn, on engines of their own in one process: programmatic dependent launch, the
GEMV tile for short rows, and the decode split count. Reports the median time per output
token of a few repeats of `bench/offline.py`'s W2.

    PYTHONPATH=. python bench/batch1_ablation.py --out ablation.json [--repeats 3]"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from offline import engine_for, ids_only_view, run_batch1_decode
from roofline import measure_roofline, w2_bound_ms

from kvstrata.attention import triton_paged
from kvstrata.engine.engine import Engine
from kvstrata.model import triton_gemv
from kvstrata.model.config import ModelConfig
from kvstrata.model.tiny import make_tiny_model
from kvstrata.model.triton_gemv import GemvConfig


@contextmanager
def gemv_config(config: GemvConfig) -> Iterator[None]:
    saved = triton_gemv.GEMV_CONFIG
    triton_gemv.GEMV_CONFIG = config
    try:
        yield
    finally:
        triton_gemv.GEMV_CONFIG = saved


@contextmanager
def max_splits(count: int) -> Iterator[None]:
    saved = triton_paged.MAX_SPLITS
    triton_paged.MAX_SPLITS = count
    try:
        yield
    finally:
        triton_paged.MAX_SPLITS = saved


@contextmanager
def nothing() -> Iterator[None]:
    yield


# name: (patch, engine config overrides)
VARIANTS: dict[str, tuple[Callable[[], Any], dict[str, Any]]] = {
    "default": (nothing, {}),
    "no_pdl": (nothing, {"disable_pdl": True}),
    "gemv_8x512": (lambda: gemv_config(GemvConfig(8, 512, 4, 3)), {}),
    "no_pdl_gemv_8x512": (lambda: gemv_config(GemvConfig(8, 512, 4, 3)), {"disable_pdl": True}),
    "max_splits_16": (lambda: max_splits(16), {}),
}


def profile_w2(engine: Engine, vocab: int) -> str:
    """Kernel table of 20 graph-replayed batch-1 decode steps at 2k context, and the
    summed kernel time per step (the rest of a step's wall time is gaps and host)."""
    from torch.profiler import ProfilerActivity, profile

    from kvstrata import SamplingParams

    engine.add_request(torch.randint(0, vocab, (2048,)).tolist(),
                       SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))  # fmt: skip
    for _ in range(10):
        engine.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            engine.step()
    while engine.has_unfinished:
        engine.step()
    engine.flush_cache()
    events = prof.key_averages()
    total_us = sum(e.device_time_total for e in events) / 20
    table = events.table(sort_by="device_time_total", row_limit=25)
    return f"{table}\nkernel time per step: {total_us:.1f} us"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", default="/tmp/kvstrata-bench")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--profile", action="store_true", help="Kernel table, first variant.")
    args = parser.parse_args()
    roof = measure_roofline()
    model_dir = Path(args.workdir) / "qwen3-8b"
    if not (model_dir / "config.json").is_file():
        make_tiny_model(model_dir, preset="qwen3-8b", seed=0, device="cuda")
    config = ModelConfig.from_dir(model_dir)
    bound_ms = w2_bound_ms(config, roof, 2048, 128)["weights_ms"]
    results: dict[str, Any] = {"roofline": roof, "w2_weights_bound_ms": bound_ms}
    print("roofline", roof, "W2 bound ms", round(bound_ms, 3), flush=True)
    for name in args.variants.split(","):
        patch, overrides = VARIANTS[name]
        with patch():
            engine, _ = engine_for(ids_only_view(model_dir), cuda_graph_max_bs=8, **overrides)
            runs = [run_batch1_decode(engine, config.vocab_size, seed=2 + i)
                    for i in range(args.repeats)]  # fmt: skip
            if args.profile and name == args.variants.split(",")[0]:
                print(profile_w2(engine, config.vocab_size), flush=True)
        tpot = statistics.median(run["tpot_ms_mean"] for run in runs)
        results[name] = {"tpot_ms": tpot, "x_bound": tpot / bound_ms, "runs": runs}
        print(f"{name:16s} {tpot:.3f} ms/token = {tpot / bound_ms:.3f}x bound "
              f"(runs {[round(r['tpot_ms_mean'], 3) for r in runs]})", flush=True)  # fmt: skip
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
