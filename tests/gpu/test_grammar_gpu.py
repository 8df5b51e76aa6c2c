"""Constrained decoding on CUDA (engine/grammar.py): xgrammar's CUDA bitmask path under
CUDA graphs and the overlapped step gives outputs that parse and validate against their
schemas, token for token the same as the eager synchronous path (fp32, greedy), with
unconstrained rows of the same batch untouched by the mask."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from kvstrata import LLM, SamplingParams
from kvstrata.core import FinishReason

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_grammar import random_schema, schema_spec

pytest.importorskip("xgrammar")
NUM_SCHEMAS = 48


def run(model_dir: Path, prompts: list[list[int]], params: list[SamplingParams], **config: Any):
    llm = LLM(
        model_dir,
        device="cuda",
        dtype="float32",
        page_size=16,
        num_kv_pages=1024,
        cuda_graph_max_bs=64,
        **config,
    )
    outs = llm.generate(input_ids=prompts, sampling_params=params)
    assert llm.engine.sampler.grammars.num_rejected_tokens == 0
    del llm
    torch.cuda.empty_cache()
    return outs


def test_constrained_outputs_on_cuda_match_eager_and_validate(tiny_llama: Path) -> None:
    rng = random.Random(30)
    schemas = [random_schema(rng) for _ in range(NUM_SCHEMAS)]
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(1, 40))] for _ in schemas]
    params = [
        SamplingParams(max_tokens=300, temperature=0.0, grammar=schema_spec(s)) for s in schemas
    ]
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts += prompts[:8]  # unconstrained rows in the same batches
    params += [free] * 8
    graphs = run(tiny_llama, prompts, params)
    eager = run(tiny_llama, prompts, params, disable_cuda_graph=True)
    assert [o.output_ids for o in graphs] == [o.output_ids for o in eager]
    for schema, out in zip(schemas, graphs):
        assert out.finish_reason is FinishReason.STOP, (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    alone = run(tiny_llama, prompts[-8:], [free] * 8)
    assert [o.output_ids for o in graphs[-8:]] == [o.output_ids for o in alone]
