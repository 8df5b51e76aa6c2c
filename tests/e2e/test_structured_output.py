"""Structured output on live ranks: `response_format` (json_object, json_schema) through
the official `openai` client, its `parse` helper with a pydantic model, streamed; `regex`
and `ebnf` on completions; `json_schema` / `regex` in /generate's sampling_params; bad
grammars refused with a 400 naming the field before the engine sees them; and through a
prefill and a decode rank, the grammar crossing the rank-to-rank wire, the same tokens as
one unified engine."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pydantic
import pytest
from pd_harness import PAGE, assert_rank_idle, start_decode, start_prefill
from server_harness import ServerProcess, assert_idle

from kvstrata import LLM, SamplingParams
from kvstrata.core import GrammarKind, GrammarSpec

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture()
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def schema_format(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": schema, "strict": True},
    }


def test_chat_json_schema_and_json_object(client: openai.OpenAI, http: httpx.Client) -> None:
    for seed in range(3):
        answer = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            response_format=schema_format(PERSON),  # type: ignore[arg-type]
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    anything = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=300,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content or ""), dict)
    assert_idle(http)


def test_the_clients_parse_helper_gets_its_model(client: openai.OpenAI) -> None:
    parsed = client.chat.completions.parse(
        model="tiny", messages=MESSAGES, max_tokens=200, temperature=0, response_format=Person
    )
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_streamed_structured_output_joins_into_valid_json(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=200,
        temperature=0,
        stream=True,
        response_format=schema_format(PERSON),  # type: ignore[arg-type]
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_completions_take_regex_and_ebnf(client: openai.OpenAI) -> None:
    regex = r"[A-Z][a-z]{2,5} (is|was) [0-9]{1,2}"
    answer = client.completions.create(
        model="tiny",
        prompt="Age:",
        max_tokens=30,
        temperature=0.7,
        seed=1,
        n=3,
        extra_body={"regex": regex},
    )
    assert all(re.fullmatch(regex, choice.text) for choice in answer.choices)
    ebnf = 'root ::= "ok" | "no" " " [a-c]+'
    answer = client.completions.create(
        model="tiny", prompt="Say:", max_tokens=20, temperature=0, extra_body={"ebnf": ebnf}
    )
    assert re.fullmatch(r"ok|no [a-c]+", answer.choices[0].text)


def test_generate_takes_sglangs_sampling_params(http: httpx.Client) -> None:
    body = {
        "text": "x",
        "sampling_params": {
            "max_new_tokens": 200,
            "temperature": 0,
            "json_schema": json.dumps(PERSON),
        },
    }
    answer = http.post("/generate", json=body).json()
    jsonschema.validate(json.loads(answer["text"]), PERSON)
    body["sampling_params"] = {"max_new_tokens": 10, "temperature": 0, "regex": "[0-9]{4}"}
    assert re.fullmatch("[0-9]{4}", http.post("/generate", json=body).json()["text"])
    metrics = http.get("/metrics").text
    assert re.search(r"^kvstrata_grammar_rejected_tokens 0\.0$", metrics, re.M)


@pytest.mark.parametrize(
    ("path", "extra", "param", "code"),
    [
        (
            "/v1/chat/completions",
            {"response_format": schema_format({"type": "object", "properties": 5})},
            "response_format",
            "invalid_grammar",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "invalid_value",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_object"}, "regex": "a+"},
            "regex",
            "invalid_value",
        ),
        ("/v1/completions", {"regex": "(unclosed"}, "regex", "invalid_grammar"),
        ("/v1/completions", {"ebnf": "root ::= nothing_here"}, "ebnf", "invalid_grammar"),
        ("/v1/completions", {"regex": "a" * (70 << 10)}, "regex", "invalid_value"),
    ],
)
def test_bad_grammars_are_refused_naming_the_field(
    http: httpx.Client, path: str, extra: dict, param: str, code: str
) -> None:
    body = {"model": "tiny", "max_tokens": 5}
    body |= {"messages": MESSAGES} if "chat" in path else {"prompt": "x"}
    response = http.post(path, json=body | extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert_idle(http)


def test_constrained_output_through_pd_equals_unified(tiny_llama: Path, tmp_path: Path) -> None:
    """The decode rank's grammar crosses the wire in the task; the prefill rank samples
    the first token under it, the decode rank's matcher takes it and goes on."""
    prefill = start_prefill(tiny_llama, tmp_path)
    decode = start_decode(tiny_llama, tmp_path, [prefill.base_url])
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(PERSON))
    prompts = [[7, 8, 9, 10, 11], [3] * 21, [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    try:
        with httpx.Client(base_url=decode.base_url, timeout=120) as http:
            got = [
                http.post(
                    "/generate",
                    json={
                        "input_ids": prompt,
                        "sampling_params": {
                            "max_new_tokens": 200,
                            "temperature": 0,
                            "json_schema": spec.source,
                        },
                    },
                ).json()
                for prompt in prompts
            ]
            assert_rank_idle(http)
            assert http.get("/metrics").text.count("kvstrata_grammar_rejected_tokens 0.0") == 1
        with httpx.Client(base_url=prefill.base_url, timeout=60) as http:
            assert_rank_idle(http)
    finally:
        assert decode.stop() == 0, decode.log()
        assert prefill.stop() == 0, prefill.log()
    params = SamplingParams(max_tokens=200, temperature=0.0, grammar=spec)
    with LLM(str(tiny_llama), page_size=PAGE, num_kv_pages=256) as llm:
        want = llm.generate(input_ids=prompts, sampling_params=params)
    assert [g["output_ids"] for g in got] == [w.output_ids for w in want]
    assert all(g["usage"]["kvstrata"]["transferred_tokens"] > 0 for g in got)
