"""Constrained decoding (engine/grammar.py): outputs match their grammar (JSON schemas,
JSON objects, regexes, EBNF) on a real engine, under every sampling feature it composes
with, and through a PD handoff token for token as on a unified rank (fp32, greedy)."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kvstrata import LLM, SamplingParams
from kvstrata.core import FinishReason, GrammarKind, GrammarSpec
from kvstrata.engine.engine import Engine
from kvstrata.engine.grammar_compiler import GrammarError

sys.path.insert(0, str(Path(__file__).parent))
from test_pd_engine import make_pair

NUM_SCHEMAS = 200


def schema_spec(schema: dict[str, Any]) -> GrammarSpec:
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A bounded schema (every string, array and integer has a bound), so a random model's
    output ends within the token budget."""
    kinds = ["string", "integer", "boolean", "enum", "array"] + (["object"] * (depth < 2))
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "a b", 'q"uote', 7, None], 3)}
    if kind == "array":
        item = random_schema(rng, depth + 1)
        return {"type": "array", "items": item, "maxItems": rng.randint(1, 3)}
    names = rng.sample(["id", "name", "tags", "ok", "score", "kind", "meta"], rng.randint(1, 4))
    properties = {name: random_schema(rng, depth + 1) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def test_generated_schemas_give_valid_json(tiny_llama: Path) -> None:
    """200 random bounded schemas, greedy and sampled: every output parses (strict JSON:
    no raw control characters) and validates against its schema."""
    rng = random.Random(29)
    schemas = [random_schema(rng) for _ in range(NUM_SCHEMAS)]
    with LLM(str(tiny_llama), page_size=16, num_kv_pages=2048) as llm:
        params = [
            SamplingParams(
                max_tokens=400,
                temperature=0.0 if i % 2 else 1.0,
                seed=i,
                grammar=schema_spec(schema),
            )
            for i, schema in enumerate(schemas)
        ]
        prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(1, 12))] for _ in schemas]
        outs = llm.generate(input_ids=prompts, sampling_params=params)
        assert llm.engine.sampler.grammars.num_rejected_tokens == 0
        assert llm.engine.sampler.grammars.num_tracked == 0  # released with their requests
    for schema, out in zip(schemas, outs):
        assert out.finish_reason is FinishReason.STOP, (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_a_bounded_string_never_takes_a_raw_control_character(tiny_llama: Path) -> None:
    """xgrammar 0.2 admits U+0000-U+001F in a length-bounded string (its issue #800); the
    compiler mends the grammar, so JSON stays JSON."""
    import xgrammar as xgr

    with LLM(str(tiny_llama), page_size=16, num_kv_pages=64) as llm:
        schema = {
            "type": "object",
            "properties": {"s": {"type": "string", "maxLength": 4}},
            "required": ["s"],
        }
        compiled = llm.engine.sampler.grammars.compile(schema_spec(schema))
        for text, ok in (('{"s": "ab', True), ('{"s": "a\x1f', False), ('{"s": "\t', False)):
            assert xgr.GrammarMatcher(compiled.handle).accept_string(text) is ok, text


@pytest.mark.parametrize(
    ("kind", "source", "check"),
    [
        (GrammarKind.REGEX, r"(cat|dog)-[0-9]{2,3}", r"(cat|dog)-[0-9]{2,3}"),
        (GrammarKind.EBNF, 'root ::= "yes" | "no" | "maybe " [0-9]', r"yes|no|maybe [0-9]"),
        (GrammarKind.JSON_OBJECT, "", None),
    ],
)
def test_regex_ebnf_and_json_object(
    tiny_llama: Path, kind: GrammarKind, source: str, check: str | None
) -> None:
    with LLM(str(tiny_llama), page_size=16, num_kv_pages=512) as llm:
        params = SamplingParams(
            max_tokens=200, temperature=1.0, seed=4, n=4, grammar=GrammarSpec(kind, source)
        )
        outs = llm.generate(input_ids=[[5, 6, 7], [9]], sampling_params=params)
    for out in outs:
        if check is not None:
            assert re.fullmatch(check, out.text), out.text
        elif out.finish_reason is FinishReason.STOP:
            assert isinstance(json.loads(out.text), dict)


def test_it_composes_with_logprobs_penalties_stops_and_ignore_eos(tiny_llama: Path) -> None:
    """Logprobs are of the masked distribution (every alternative is a token the grammar
    allowed); penalties and min_tokens adjust within the mask; a stop string ends the
    output where it falls; with ignore_eos the grammar's end still ends it."""
    import xgrammar as xgr

    spec = GrammarSpec(GrammarKind.REGEX, r"(ab|cd)+e")
    with LLM(str(tiny_llama), page_size=16, num_kv_pages=512) as llm:
        params = SamplingParams(
            max_tokens=40,
            temperature=0.8,
            seed=2,
            logprobs=3,
            presence_penalty=1.5,
            repetition_penalty=1.3,
            min_tokens=3,
            grammar=spec,
            ignore_eos=True,
        )
        (out,) = llm.generate(input_ids=[[3, 4]], sampling_params=params)
        assert re.fullmatch(r"(ab|cd)+e", out.text), out.text
        assert out.finish_reason is FinishReason.STOP
        assert out.logprobs is not None and len(out.logprobs) == len(out.output_ids)
        matcher = xgr.GrammarMatcher(llm.engine.sampler.grammars.compile(spec).handle)
        for token_id, record in zip(out.output_ids, out.logprobs):
            assert record.top, "alternatives were asked for"
            for alternative, logprob in record.top:  # each one the grammar allowed here
                assert logprob == float("-inf") or matcher.fork().accept_token(alternative)
            assert matcher.accept_token(token_id)
        stopped = SamplingParams(max_tokens=40, temperature=0.0, stop=("d",), grammar=spec)
        (cut,) = llm.generate(input_ids=[[3, 4]], sampling_params=stopped)
        assert "d" not in cut.text and cut.finish_reason is FinishReason.STOP


def test_the_overlapped_step_masks_as_the_synchronous_one(tiny_llama: Path) -> None:
    """Greedy constrained rows join the overlapped decode step (the next step's forward
    launched before this one's tokens reach the matchers; its mask filled after): the same
    tokens as the synchronous step, with unconstrained rows in the same batches, grammars
    that end at different steps and an eos that ends a free row early."""
    rng = random.Random(31)
    schemas = [random_schema(rng) for _ in range(24)]
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(1, 12))] for _ in range(32)]
    params = [
        SamplingParams(max_tokens=200, temperature=0.0, grammar=schema_spec(s)) for s in schemas
    ]
    params += [SamplingParams(max_tokens=30, temperature=0.0)] * 8
    outputs = {}
    for mode in ("off", "on"):
        with LLM(str(tiny_llama), page_size=16, num_kv_pages=2048, overlap_schedule=mode) as llm:
            outs = llm.generate(input_ids=prompts, sampling_params=params)
            assert llm.engine.sampler.grammars.num_rejected_tokens == 0
            overlapped = getattr(llm.engine.stepper, "num_overlapped_steps", 0)
            counters = llm.engine.metrics()  # how the steps ran, as /metrics shows them
            assert counters.get("steps_overlapped", 0) == overlapped
            assert counters["steps_sync"] > 0 and counters["step_seconds_stepper"] > 0
            assert (counters.get("overlap_lost_length", 0) > 0) == (mode == "on")
        outputs[mode] = [out.output_ids for out in outs]
        assert (overlapped > 0) == (mode == "on")
        for schema, out in zip(schemas, outs):
            jsonschema.validate(json.loads(out.text), schema)
    assert outputs["on"] == outputs["off"]


def test_preempted_requests_keep_their_grammar(tiny_llama: Path) -> None:
    """A pool too small for every request at once: requests are preempted and recomputed;
    their matchers keep their place, so the output is what it is unpreempted."""
    digits = {"type": "integer", "minimum": 0, "maximum": 9}
    spec = schema_spec({"type": "array", "items": digits, "minItems": 8, "maxItems": 12})
    params = SamplingParams(max_tokens=60, temperature=0.0, grammar=spec)
    prompts = [[random.Random(k).randrange(1, 500) for _ in range(30)] for k in range(6)]
    with LLM(str(tiny_llama), page_size=4, num_kv_pages=400) as roomy:
        alone = roomy.generate(input_ids=prompts, sampling_params=params)
    with LLM(str(tiny_llama), page_size=4, num_kv_pages=24) as tight:
        squeezed = tight.generate(input_ids=prompts, sampling_params=params)
        assert tight.engine.scheduler.num_preemptions > 0
    assert [o.output_ids for o in squeezed] == [o.output_ids for o in alone]
    for out in squeezed:
        assert 8 <= len(json.loads(out.text)) <= 12


def serve_pd(prefill: Engine, decode: Engine, prompt: list[int], params: SamplingParams) -> Any:
    req = decode.add_request(prompt, params)
    while True:
        for out in decode.step():
            if out.rid == req.rid and out.finished:
                return out
        for task in decode.role.take_tasks():
            p_req = prefill.role.add_prefill_task(task)
            while prefill.has_unfinished:
                prefill.step()
            out = decode.role.complete_transfer(prefill.role.collect(p_req.rid))
            if out.finished:
                return out


def test_constrained_output_through_pd_equals_the_unified_rank(tiny_llama: Path) -> None:
    """The prefill rank samples the first token under the grammar; the decode rank's
    matcher takes it and goes on: greedy fp32 output equals one unified engine's."""
    rng = random.Random(30)
    schemas = [random_schema(rng) for _ in range(8)]
    prefill, decode = make_pair(tiny_llama)
    with LLM(str(tiny_llama), page_size=4, num_kv_pages=512) as unified:
        for schema in schemas:
            params = SamplingParams(max_tokens=300, temperature=0.0, grammar=schema_spec(schema))
            prompt = [rng.randrange(1, 500) for _ in range(rng.randint(5, 30))]
            (want,) = unified.generate(input_ids=[prompt], sampling_params=params)
            got = serve_pd(prefill, decode, prompt, params)
            assert got.output_ids == want.output_ids
            assert got.cache_usage.transferred_tokens > 0
    assert decode.sampler.grammars.num_rejected_tokens == 0
    prefill.close()
    decode.close()


def test_generated_schemas_through_pd_give_valid_json(tiny_llama: Path) -> None:
    """The property test through PD: 200 random bounded schemas, sampled and greedy, each
    served by a prefill and a decode engine: every output parses and validates."""
    rng = random.Random(32)
    schemas = [random_schema(rng) for _ in range(NUM_SCHEMAS)]
    prefill, decode = make_pair(tiny_llama)
    rids = {}
    for i, schema in enumerate(schemas):
        params = SamplingParams(
            max_tokens=400, temperature=0.0 if i % 2 else 1.0, seed=i, grammar=schema_spec(schema)
        )
        prompt = [rng.randrange(1, 500) for _ in range(rng.randint(1, 12))]
        rids[decode.add_request(prompt, params).rid] = schema
    finished = {}
    while len(finished) < len(rids):  # both engines batch: every task of a step at once
        outs = decode.step()
        p_reqs = [prefill.role.add_prefill_task(task) for task in decode.role.take_tasks()]
        while prefill.has_unfinished:
            prefill.step()
        outs += [decode.role.complete_transfer(prefill.role.collect(r.rid)) for r in p_reqs]
        finished |= {out.rid: out for out in outs if out.finished}
    for rid, schema in rids.items():
        out = finished[rid]
        assert out.finish_reason is FinishReason.STOP, (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert decode.sampler.grammars.num_rejected_tokens == 0
    assert decode.sampler.grammars.num_tracked == 0
    prefill.close()
    decode.close()


def test_a_first_token_the_decode_grammar_refuses_fails_that_request(tiny_llama: Path) -> None:
    """Masked sampling never picks a refused token; a prefill rank's first token under
    another grammar is one: the request fails alone with the reason, and it is counted."""
    prefill, decode = make_pair(tiny_llama)
    params = SamplingParams(
        max_tokens=10, temperature=0.0, grammar=GrammarSpec(GrammarKind.REGEX, "x+")
    )
    req = decode.add_request([5, 6, 7, 8, 9], params)
    decode.step()
    (task,) = decode.role.take_tasks()
    task.sampling["grammar"] = {"kind": "regex", "source": "y+"}  # what a bad peer sends
    p_req = prefill.role.add_prefill_task(task)
    while prefill.has_unfinished:
        prefill.step()
    out = decode.role.complete_transfer(prefill.role.collect(p_req.rid))
    assert out.rid == req.rid and out.finished and out.error is not None
    assert "does not match the request's regex" in out.error.message
    assert decode.sampler.grammars.num_rejected_tokens == 1
    assert decode.metrics()["grammar_rejected_tokens"] == 1
    prefill.close()
    decode.close()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec(GrammarKind.JSON_SCHEMA, "{not json"), "not JSON"),
        (GrammarSpec(GrammarKind.JSON_SCHEMA, "[1]"), "must be a JSON object"),
        (GrammarSpec(GrammarKind.REGEX, "(unclosed"), "invalid regex"),
        (GrammarSpec(GrammarKind.EBNF, "root ::= missing_rule"), "invalid ebnf"),
        (GrammarSpec(GrammarKind.REGEX, "a" * (65 << 10)), "at most 65536 are accepted"),
    ],
)
def test_bad_grammars_are_refused_naming_the_problem(
    tiny_llama: Path, spec: GrammarSpec, message: str
) -> None:
    with LLM(str(tiny_llama), page_size=16, num_kv_pages=64) as llm:
        with pytest.raises(GrammarError, match=message):
            llm.generate(input_ids=[[1, 2]], sampling_params=SamplingParams(grammar=spec))
        assert not llm.engine.has_unfinished and not llm.engine.requests


def test_the_pd_wire_carries_every_sampling_field_the_grammar_included() -> None:
    """A decode rank's task names every SamplingParams field, and a prefill rank rebuilds
    the same params from the checked message (the grammar as a GrammarSpec)."""
    import dataclasses

    from kvstrata.disagg.wire import WireSampling

    assert set(WireSampling.model_fields) == {f.name for f in dataclasses.fields(SamplingParams)}
    params = SamplingParams(max_tokens=9, grammar=GrammarSpec(GrammarKind.REGEX, "a|b"))
    sent = json.loads(json.dumps(dataclasses.asdict(params)))  # as it travels
    checked = WireSampling.model_validate(sent).model_dump()
    assert SamplingParams(**checked) == params
