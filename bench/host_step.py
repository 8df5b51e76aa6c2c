"""Host time of a big-batch decode step, on CPU: the engine's own Python work per step
(scheduling, step inputs, sampling's host side, token commits, stop checks, outputs)
with the model excluded, for W3's shape (256 requests x 512 prompt tokens, 128 greedy
output tokens, ignore_eos) on a tiny random model.

    PYTHONPATH=. python bench/host_step.py [--overlap on|off] [--model stub|real]
        [--profile 30]

How the model is excluded: the model's `forward` and `compute_logits` are wrapped with a
timer and their seconds are subtracted from each step's wall time. With `--model stub`
(the default) `forward` returns zero hidden states at once, so every request samples
token 0: the host path is the same (same requests, pages, steps and stop checks; every
request runs to max_tokens either way) and the host code runs with warm CPU caches, as
it does beside a GPU. With `--model real` the tiny model runs on the CPU and its
attention over 131k cached tokens evicts the host's caches between steps, which adds
about half a millisecond of cache misses to the host time. Only steps whose batch is all
decodes of every request count. Also reported: the host cost of packing a decode step for
CUDA-graph replay (`DecodeInputPacker`, run on CPU tensors), which the GPU path adds."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvstrata import SamplingParams
from kvstrata.config import EngineConfig
from kvstrata.engine import runner as runner_module
from kvstrata.engine.cuda_graph import DecodeInputPacker, graph_batch_sizes, padded_batch_size
from kvstrata.engine.engine import Engine
from kvstrata.model.tiny import make_tiny_model

NUM_PROMPTS, PROMPT_LEN, OUTPUT_LEN = 256, 512, 128


class ModelClock:
    """Seconds spent inside the model (forward and logits) since the last `take`; with
    `hidden_size`, the forward is a stub returning zero hidden states of that width."""

    def __init__(self, model: Any, hidden_size: int | None) -> None:
        self.model_s = 0.0
        if hidden_size is not None:
            model.forward = lambda ids, *_: torch.zeros(ids.shape[0], hidden_size)
        for name in ("forward", "compute_logits"):
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.model_s += time.perf_counter() - start

        return timed

    def take(self) -> float:
        model_s, self.model_s = self.model_s, 0.0
        return model_s


def build_engine(model_dir: Path, overlap: str) -> Engine:
    config = EngineConfig.from_flags(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        num_kv_pages=NUM_PROMPTS * (-(-(PROMPT_LEN + OUTPUT_LEN) // 16)) + 64,
        overlap_schedule=overlap,
    )
    return Engine(config)


def add_requests(engine: Engine, seed: int) -> None:
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (NUM_PROMPTS, PROMPT_LEN), generator=gen).tolist()
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    for ids in prompts:
        engine.add_request(ids, params)


def is_full_decode(engine: Engine) -> bool:
    """Every request runs and each has exactly its last sampled token left to compute."""
    running = engine.scheduler.running
    return len(running) == NUM_PROMPTS and all(
        req.num_tokens - req.num_computed_tokens == 1 for req in running
    )


class PackingClock:
    """Packs every decode step the runner builds for CUDA-graph replay as the GPU path
    would (on CPU tensors, nothing is copied to a device) and times it."""

    def __init__(self, engine: Engine) -> None:
        self.pack_s = 0.0
        self.sizes = graph_batch_sizes(engine.config.speed.cuda_graph_max_bs)
        max_pages = -(-engine.max_model_len // engine.config.pool.page_size)
        self.packer = DecodeInputPacker(self.sizes[-1], max_pages)
        for name in ("build_step_inputs", "decode_step_inputs"):
            setattr(runner_module, name, self._packing(getattr(runner_module, name)))

    def _packing(self, build: Any) -> Any:
        def build_and_pack(*args: Any) -> Any:
            step = build(*args)
            bs = padded_batch_size(self.sizes, step.num_seqs)
            if step.is_decode and bs is not None:
                start = time.perf_counter()
                self.packer.pack(step, bs)
                self.pack_s += time.perf_counter() - start
            return step

        return build_and_pack

    def take(self) -> float:
        pack_s, self.pack_s = self.pack_s, 0.0
        return pack_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overlap", choices=("on", "off"), default="off")
    parser.add_argument("--model", choices=("stub", "real"), default="stub")
    parser.add_argument("--profile", type=int, default=0, help="profile this many decode steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny", arch="qwen3", seed=0)
        for path in model_dir.glob("tokenizer*"):  # ids only, like bench/offline.py's W3
            path.unlink()
        engine = build_engine(model_dir, args.overlap)
        add_requests(engine, args.seed)
        stub_width = engine.model_config.hidden_size if args.model == "stub" else None
        clock = ModelClock(engine.model, stub_width)
        while not is_full_decode(engine):
            engine.step()
        packing = PackingClock(engine)
        clock.take()
        host_ms: list[float] = []
        pack_ms: list[float] = []
        profiler = cProfile.Profile() if args.profile else None
        num_steps = 0
        while engine.has_unfinished and is_full_decode(engine):
            profiled = profiler is not None and 5 <= num_steps < 5 + args.profile
            if profiled:
                profiler.enable()
            start = time.perf_counter()
            engine.step()
            wall_s = time.perf_counter() - start
            if profiled:
                profiler.disable()
            num_steps += 1
            pack_s, model_s = packing.take(), clock.take()
            if num_steps > 2 and not profiled:  # the first steps warm caches and allocators
                host_ms.append((wall_s - model_s - pack_s) * 1e3)
                pack_ms.append(pack_s * 1e3)
        while engine.has_unfinished:
            engine.step()

    print(f"overlap={args.overlap} model={args.model} batch={NUM_PROMPTS} steps={len(host_ms)}")
    print(
        f"host ms/step excluding the model: median {statistics.median(host_ms):.3f}  "
        f"mean {statistics.mean(host_ms):.3f}  min {min(host_ms):.3f}"
    )
    print(f"graph input packing (GPU path only) ms/step: median {statistics.median(pack_ms):.3f}")
    if profiler is not None:
        stats = pstats.Stats(profiler)
        # Leave out the model's own functions (its builtins, e.g. attention, still show).
        stats.sort_stats("tottime").print_stats(r"^(?!.*(attention|model)/)", 30)


if __name__ == "__main__":
    main()
