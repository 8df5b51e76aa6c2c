"""Structured output's cost (issue 30): the decode step of a batch where every request has
a json_schema against the same batch unconstrained (target on an H200: within +5%), where
the difference goes (the host's bitmask fill per step), and how long the schemas of the
test set (tests/unit/test_grammar.py's generator) take to compile, p50/p99.

    PYTHONPATH=. python bench/structured_output.py --model DIR [--batch 32] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvstrata import SamplingParams
from kvstrata.config import EngineConfig
from kvstrata.core import GrammarKind, GrammarSpec
from kvstrata.engine.engine import Engine
from kvstrata.engine.stepper import SyncStepper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
from test_grammar import random_schema  # the test set's schemas

# Long enough that no request ends before max_tokens: 64 strings at least.
LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "notes": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "minItems": 64,
        }
    },
    "required": ["notes"],
    "additionalProperties": False,
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def compile_times(engine: Engine, num_schemas: int) -> dict[str, Any]:
    """Cold compiles (distinct schemas, the compiler's cache never hit), in ms."""
    start = time.perf_counter()
    compiler = engine.sampler.grammars.compiler  # the tokenizer's info, built once
    made_ms = (time.perf_counter() - start) * 1e3
    rng = random.Random(0)
    times_ms = []
    for _ in range(num_schemas):
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(random_schema(rng)))
        begin = time.perf_counter()
        compiler.compile(spec)
        times_ms.append((time.perf_counter() - begin) * 1e3)
    return {
        "num_schemas": num_schemas,
        "compiler_made_ms": made_ms,
        "compile_ms_p50": percentile(times_ms, 0.5),
        "compile_ms_p99": percentile(times_ms, 0.99),
        "compile_ms_max": max(times_ms),
    }


class DecodeSteps:
    """Wall time of the engine's decode steps whose batch holds `batch` requests, and the
    time each spent filling grammar bitmasks on the host."""

    def __init__(self, engine: Engine, batch: int) -> None:
        self.engine, self.batch = engine, batch
        self.step_ms: list[float] = []
        self.mask_ms: list[float] = []

    def run(self, prompts: list[list[int]], params: SamplingParams) -> None:
        engine, book = self.engine, self.engine.sampler.grammars
        run_batch, run_decode, mask = engine.runner.run, engine.runner.run_decode, book.mask
        full_decode = [False]
        masked_s = [0.0]

        def watched_run(batch: Any) -> torch.Tensor:
            items = batch.items
            full_decode[0] = len(items) == self.batch and all(i.num_new_tokens == 1 for i in items)
            return run_batch(batch)

        def watched_decode(items: list[Any], input_ids: torch.Tensor) -> torch.Tensor:
            full_decode[0] = len(items) == self.batch  # the overlapped step's follow-up
            return run_decode(items, input_ids)

        def watched_mask(*args: Any) -> None:
            begin = time.perf_counter()
            mask(*args)
            masked_s[0] += time.perf_counter() - begin

        engine.runner.run = watched_run  # type: ignore[method-assign]
        engine.runner.run_decode = watched_decode  # type: ignore[method-assign]
        book.mask = watched_mask  # type: ignore[method-assign]
        try:
            for ids in prompts:
                engine.add_request(ids, params)
            while engine.has_unfinished:
                masked_s[0], full_decode[0] = 0.0, False
                start = time.perf_counter()
                engine.step()  # ends with the sampled tokens on the host: synced
                if full_decode[0]:
                    self.step_ms.append((time.perf_counter() - start) * 1e3)
                    self.mask_ms.append(masked_s[0] * 1e3)
        finally:
            del engine.runner.run, engine.runner.run_decode, book.mask
        engine.flush_cache()

    def summary(self) -> dict[str, Any]:
        return {
            "full_batch_decode_steps": len(self.step_ms),
            "step_ms_mean": statistics.mean(self.step_ms),
            "step_ms_median": statistics.median(self.step_ms),
            "step_ms_p90": percentile(self.step_ms, 0.9),
            "mask_ms_mean": statistics.mean(self.mask_ms),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-schemas", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    engine = Engine(
        EngineConfig.from_flags(model=args.model, dtype="bfloat16" if on_gpu else "float32")
    )
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "model": args.model,
        "batch": args.batch,
        "compile": compile_times(engine, args.num_schemas),
    }
    print(json.dumps(result["compile"]))
    gen = torch.Generator().manual_seed(0)
    vocab = min(engine.model_config.vocab_size, 32000)
    prompts = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=gen).tolist()
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(LONG_SCHEMA))
    free = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=args.output_len, temperature=0.0, ignore_eos=True, grammar=spec
    )
    DecodeSteps(engine, args.batch).run(prompts[:4], free)  # warm-up, graphs captured
    steppers = {"default": engine.stepper, "sync": SyncStepper(engine)}
    for stepper_name, stepper in steppers.items():  # the engine's, then no overlap
        engine.stepper = stepper
        runs = {"unconstrained": DecodeSteps(engine, args.batch)}
        runs["json_schema"] = DecodeSteps(engine, args.batch)
        for _ in range(args.rounds):  # alternating, so drift hits both alike
            runs["unconstrained"].run(prompts, free)
            runs["json_schema"].run(prompts, constrained)
        part = result[stepper_name] = {name: steps.summary() for name, steps in runs.items()}
        ratio = part["json_schema"]["step_ms_mean"] / part["unconstrained"]["step_ms_mean"]
        part["json_schema_over_unconstrained"] = ratio
        print(f"{stepper_name} ({type(stepper).__name__}): {json.dumps(part)}")
    engine.stepper = steppers["default"]
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
