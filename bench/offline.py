"""Offline engine speed (issue 7): W1/W2/W3 through kvstrata, the same workloads through
transformers (`generate_batch`, `generate`), and the roofline measured in the same process.

    PYTHONPATH=. python bench/offline.py --out results.json [--workloads W1,W2,W3]
        [--skip-transformers | --transformers-workloads W2,W3] [--profile]

W1: 256 prompts x 512 tokens, 128 greedy output tokens (ignore_eos), qwen3-8b shapes, bf16.
W2: one 2048-token prompt (--w2-context), then batch-1 decode: time per output token,
qwen3-8b shapes. --kv-cache-dtype auto,fp8 runs the kvstrata side once per KV dtype.
W3: W1 with qwen3-0.6b shapes. Models are random weights written by
`make_tiny_model(preset=...)` and loaded by the engine's normal loader. Token ids in, token
ids out on both sides: the engine reads the model through a view of its directory without
the tokenizer (so it skips incremental detokenization, as transformers does here)."""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from roofline import measure_roofline, w1_lower_bound_s, w2_bound_ms

from kvstrata import SamplingParams
from kvstrata.config import EngineConfig
from kvstrata.engine.engine import Engine
from kvstrata.model.config import ModelConfig
from kvstrata.model.tiny import make_tiny_model

PRESET_OF = {"W1": "qwen3-8b", "W2": "qwen3-8b", "W3": "qwen3-0.6b"}
NUM_PROMPTS, PROMPT_LEN, OUTPUT_LEN = 256, 512, 128
W2_CONTEXT, W2_OUTPUT = 2048, 128


def sync_time() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


# ------------------------------------------------------------------ kvstrata


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=gen).tolist()


class StepTimer:
    """Wall time of each engine step, split by whether the step computed prompt tokens."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.num_steps = 0

    def run(self, prompts: list[list[int]], params: SamplingParams) -> list[float]:
        """Run all prompts to completion; returns each step's seconds."""
        for ids in prompts:
            self.engine.add_request(ids, params)
        runner = self.engine.runner
        run_batch = runner.run
        is_decode = [False]

        def watched_run(batch: Any) -> torch.Tensor:
            is_decode[0] = all(item.num_new_tokens == 1 for item in batch.items)
            return run_batch(batch)

        runner.run = watched_run  # type: ignore[method-assign]
        times = []
        try:
            while self.engine.has_unfinished:
                start = time.perf_counter()
                self.engine.step()  # ends with the sampled tokens on the host: synced
                elapsed = time.perf_counter() - start
                times.append(elapsed)
                if is_decode[0]:
                    self.decode_s += elapsed
                else:
                    self.prefill_s += elapsed
        finally:
            del runner.run  # back to the class's method
        self.num_steps += len(times)
        return times


def ids_only_view(model_dir: Path) -> Path:
    """A sibling directory linking every file of `model_dir` except the tokenizer's."""
    view = model_dir.with_name(model_dir.name + "-ids")
    view.mkdir(exist_ok=True)
    for path in model_dir.iterdir():
        link = view / path.name
        if not path.name.startswith("tokenizer") and not link.exists():
            link.symlink_to(path.resolve())
    return view


def engine_for(model_dir: Path, **overrides: Any) -> tuple[Engine, float]:
    start = time.perf_counter()
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # cpu: --smoke only
    engine = Engine(EngineConfig.from_flags(model=str(model_dir), dtype=dtype, **overrides))
    return engine, time.perf_counter() - start


def run_throughput(engine: Engine, vocab: int, seed: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    StepTimer(engine).run(random_prompts(8, PROMPT_LEN, vocab, seed + 100), params)  # warm-up
    engine.flush_cache()
    timer = StepTimer(engine)
    start = sync_time()
    timer.run(random_prompts(NUM_PROMPTS, PROMPT_LEN, vocab, seed), params)
    wall_s = sync_time() - start
    engine.flush_cache()
    return {
        "wall_s": wall_s,
        "output_tok_s": NUM_PROMPTS * OUTPUT_LEN / wall_s,
        "steps": timer.num_steps,
        "steps_with_prefill_s": timer.prefill_s,
        "decode_only_steps_s": timer.decode_s,
        "preemptions": engine.scheduler.num_preemptions,
    }


def run_batch1_decode(engine: Engine, vocab: int, seed: int) -> dict[str, Any]:
    prompt = random_prompts(1, W2_CONTEXT, vocab, seed)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    StepTimer(engine).run(prompt, warm)
    engine.flush_cache()
    params = SamplingParams(max_tokens=W2_OUTPUT + 1, temperature=0.0, ignore_eos=True)
    times = StepTimer(engine).run(random_prompts(1, W2_CONTEXT, vocab, seed + 1), params)
    engine.flush_cache()
    # A prompt longer than the step budget is prefilled over several steps.
    num_prefill_steps = -(-W2_CONTEXT // engine.config.scheduler.max_num_batched_tokens)
    decode = times[num_prefill_steps:]
    return {
        "prefill_ms": sum(times[:num_prefill_steps]) * 1e3,
        "tpot_ms_mean": statistics.mean(decode) * 1e3,
        "tpot_ms_median": statistics.median(decode) * 1e3,
    }


def profile_steps(engine: Engine, vocab: int, num_prompts: int, prompt_len: int) -> str:
    """Kernel tables of eager steps (graphs off for the trace): the first two steps (with
    prompt tokens) and three decode steps of `num_prompts` prompts."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()  # cpu: --smoke only

    def table(num_steps: int) -> str:
        with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as p:
            for _ in range(num_steps):
                engine.step()
        sort_by = "cuda_time_total" if on_gpu else "cpu_time_total"
        return p.key_averages().table(sort_by=sort_by, row_limit=14)

    graphs, engine.runner.graphs = engine.runner.graphs, None
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for ids in random_prompts(num_prompts, prompt_len, vocab, 7):
            engine.add_request(ids, params)
        prefill = table(2)
        while any(r.num_computed_tokens < r.prompt_len for r in engine.scheduler.running):
            engine.step()
        decode = table(3)
        while engine.has_unfinished:
            engine.step()
        engine.flush_cache()
    finally:
        engine.runner.graphs = graphs
    title = f"{num_prompts} x {prompt_len}"
    return f"== profile {title}: 2 steps with prompt tokens\n{prefill}\n" + (
        f"== profile {title}: 3 decode steps\n{decode}"
    )


# ------------------------------------------------------------------ transformers


def hf_model(model_dir: Path) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: --smoke only
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def hf_generate_batch(model: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """transformers' continuous batching (`generate_batch`); on failure, batched
    `generate` (the prompts have equal lengths, so no padding)."""
    from transformers import GenerationConfig

    # No eos: generate_batch then runs every request to max_new_tokens (ignore_eos).
    gen_config = GenerationConfig(max_new_tokens=OUTPUT_LEN, do_sample=False, pad_token_id=0)
    result: dict[str, Any] = {}
    try:
        start = sync_time()
        outs = model.generate_batch(inputs=prompts, generation_config=gen_config)
        wall_s = sync_time() - start
        num_out = sum(len(out.generated_tokens) for out in outs.values())
        result.update(api="generate_batch", wall_s=wall_s, output_tokens=num_out)
    except Exception as e:  # report and fall back; the comparison still needs a number
        result["generate_batch_error"] = f"{type(e).__name__}: {e}"[:500]
        ids = torch.tensor(prompts, device=model.device)
        start = sync_time()
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=OUTPUT_LEN,
            min_new_tokens=OUTPUT_LEN, do_sample=False, pad_token_id=0,
        )  # fmt: skip
        wall_s = sync_time() - start
        num_out = (out.shape[1] - ids.shape[1]) * len(prompts)
        result.update(api="generate", wall_s=wall_s, output_tokens=num_out)
    result["output_tok_s"] = result["output_tokens"] / result["wall_s"]
    return result


def hf_tpot(model: Any, vocab: int, seed: int) -> dict[str, Any]:
    """`generate` on one 2048-token prompt: (time for 1 + n tokens - time for 1) / n."""
    ids = torch.tensor(random_prompts(1, W2_CONTEXT, vocab, seed), device=model.device)

    def timed(num_new: int) -> float:
        start = sync_time()
        model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new,
            min_new_tokens=num_new, do_sample=False, pad_token_id=0,
        )  # fmt: skip
        return sync_time() - start

    timed(2)  # warm-up
    n = 32
    one, many = timed(1), timed(1 + n)
    return {"tpot_ms": (many - one) / n * 1e3, "api": "generate"}


# ------------------------------------------------------------------ driver


def run_workload(
    name: str, engine: Engine, config: ModelConfig, roof: dict[str, float]
) -> dict[str, Any]:
    if name == "W2":
        res = run_batch1_decode(engine, config.vocab_size, seed=2)
        kv_itemsize = engine.pool.data.element_size()
        res["bound"] = w2_bound_ms(config, roof, W2_CONTEXT, W2_OUTPUT, kv_itemsize)
        res["context_len"] = W2_CONTEXT
        res["x_weights_bound"] = res["tpot_ms_mean"] / res["bound"]["weights_ms"]
        return res
    res = run_throughput(engine, config.vocab_size, seed=1)
    res["bound"] = w1_lower_bound_s(config, roof, NUM_PROMPTS, PROMPT_LEN, OUTPUT_LEN)
    res["x_bound"] = res["wall_s"] / res["bound"]["total_s"]
    return res


def _shrink_for_smoke() -> None:
    global NUM_PROMPTS, PROMPT_LEN, OUTPUT_LEN, W2_CONTEXT, W2_OUTPUT
    NUM_PROMPTS, PROMPT_LEN, OUTPUT_LEN, W2_CONTEXT, W2_OUTPUT = 4, 32, 8, 64, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="JSON file for the results.")
    parser.add_argument("--workdir", default="/tmp/kvstrata-bench", help="Model directories.")
    parser.add_argument("--workloads", default="W1,W2,W3")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--transformers-workloads", default=None, help="Subset run through transformers."
    )
    parser.add_argument(
        "--overlap-schedule", default="auto",
        help="Comma-separated --overlap-schedule modes; each runs the kvstrata workloads "
        "on an engine of its own (the first is reported as `kvstrata`).",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="Comma-separated --kv-cache-dtype values (e.g. auto,fp8); each runs the kvstrata "
        "workloads on an engine of its own, reported as kvstrata_overlap_<mode>_kv_<dtype>.",
    )
    parser.add_argument(
        "--w2-context", type=int, default=None, help="W2's prompt length (default 2048)."
    )
    parser.add_argument("--tp-size", type=int, default=1, help="Tensor-parallel workers.")
    parser.add_argument("--profile", action="store_true", help="Print a decode kernel profile.")
    parser.add_argument(
        "--smoke", action="store_true", help="Check this script on CPU: tiny model and sizes."
    )
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        parser.error(
            "W1-W3 and the roofline are measured on a CUDA GPU, and torch sees none "
            f"(torch {torch.__version__}); --smoke checks this script on CPU with a tiny model"
        )
    workloads = args.workloads.split(",")
    results: dict[str, Any] = {"workloads": workloads}
    if args.smoke:
        _shrink_for_smoke()
    if args.w2_context:
        global W2_CONTEXT
        W2_CONTEXT = args.w2_context

    def save() -> None:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")

    import transformers
    import triton

    results["env"] = {
        "gpu": torch.cuda.get_device_name() if not args.smoke else "cpu (smoke)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    roof = {"matmul_tflops": 1.0, "hbm_gbps": 10.0} if args.smoke else measure_roofline()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    results["roofline"] = roof
    print("roofline", roof, flush=True)
    save()
    presets = sorted({PRESET_OF[w] for w in workloads}, key=lambda p: p != "qwen3-0.6b")
    for preset in presets:
        model_dir = Path(args.workdir) / preset
        start = time.perf_counter()
        if not (model_dir / "config.json").is_file():
            if args.smoke:
                make_tiny_model(model_dir, arch="qwen3", seed=0)
            else:
                make_tiny_model(model_dir, preset=preset, seed=0, device="cuda")
        results[f"{preset}_write_s"] = time.perf_counter() - start
        config = ModelConfig.from_dir(model_dir)
        variants = [
            (mode, kv)
            for mode in args.overlap_schedule.split(",")
            for kv in args.kv_cache_dtype.split(",")
        ]
        for index, (mode, kv) in enumerate(variants):
            engine, load_s = engine_for(
                ids_only_view(model_dir),
                overlap_schedule=mode,
                kv_cache_dtype=kv,
                tp_size=args.tp_size,
            )
            results[f"{preset}_engine_start_s"] = load_s
            results[f"{preset}_kv_pages"] = engine.allocator.num_total_pages
            up_s = round(load_s, 1)
            print(preset, "engine up in", up_s, "s, overlap", mode, "kv", kv, flush=True)
            for name in workloads:
                if PRESET_OF[name] != preset:
                    continue
                res = run_workload(name, engine, config, roof)
                res["overlap_schedule"], res["kv_cache_dtype"] = mode, kv
                if not args.smoke:
                    res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / (1 << 30)
                entry = results.setdefault(name, {})
                entry[f"kvstrata_overlap_{mode}" + ("" if kv == "auto" else f"_kv_{kv}")] = res
                if index == 0:
                    entry["kvstrata"] = res
                print(name, json.dumps(res), flush=True)
                save()
            if args.profile and index == 0:
                if preset == "qwen3-8b":
                    print(profile_steps(engine, config.vocab_size, 1, 1024), flush=True)
                print(profile_steps(engine, config.vocab_size, 256, 512), flush=True)
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if args.skip_transformers:
            continue
        hf_workloads = (args.transformers_workloads or args.workloads).split(",")
        hf_names = [w for w in workloads if w in hf_workloads and PRESET_OF[w] == preset]
        if not hf_names:
            continue
        model = hf_model(model_dir)
        for name in hf_names:
            try:
                if name == "W2":
                    res = hf_tpot(model, config.vocab_size, seed=3)
                else:
                    prompts = random_prompts(NUM_PROMPTS, PROMPT_LEN, config.vocab_size, seed=1)
                    res = hf_generate_batch(model, prompts)
            except Exception as e:
                res = {"error": f"{type(e).__name__}: {e}"[:500]}
            results[name]["transformers"] = res
            print(name, "transformers", json.dumps(res), flush=True)
            save()
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    sys.exit(main())
