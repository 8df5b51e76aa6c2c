"""The grammar a request's output must match, from its fields: OpenAI's `response_format`
(`json_object`, `json_schema`) and the `regex` / `ebnf` extensions on chat and
completions (vLLM's and SGLang's names), or `json_schema` / `regex` / `ebnf` in
/generate's `sampling_params` (SGLang's). At most one may be given."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, NamedTuple

from kvstrata.grammar_spec import MAX_GRAMMAR_BYTES, GrammarKind, GrammarSpec
from kvstrata.http.errors import OpenAIError

if TYPE_CHECKING:
    from kvstrata.http.protocol import NativeSamplingParams, OpenAISampling


class RequestGrammar(NamedTuple):
    spec: GrammarSpec
    param: str  # the request field it came from, named in a 400


def request_grammar(fields: OpenAISampling | NativeSamplingParams) -> RequestGrammar | None:
    """The grammar `fields` ask for (None: unconstrained); 400 naming the field when
    several are given or one is malformed."""
    given: list[RequestGrammar] = []
    response_format = getattr(fields, "response_format", None)
    if response_format is not None and response_format.type != "text":
        given.append(RequestGrammar(_response_format_spec(response_format), "response_format"))
    json_schema = getattr(fields, "json_schema", None)
    if json_schema is not None:
        given.append(
            RequestGrammar(GrammarSpec(GrammarKind.JSON_SCHEMA, json_schema), "json_schema")
        )
    for name, kind in (("regex", GrammarKind.REGEX), ("ebnf", GrammarKind.EBNF)):
        source = getattr(fields, name, None)
        if source is not None:
            given.append(RequestGrammar(GrammarSpec(kind, source), name))
    if len(given) > 1:
        names = " and ".join(g.param for g in given)
        raise OpenAIError(400, f"give one of {names}, not both", given[1].param, "invalid_value")
    if not given:
        return None
    grammar = given[0]
    if not grammar.spec.source and grammar.spec.kind is not GrammarKind.JSON_OBJECT:
        raise OpenAIError(400, f"{grammar.param} is empty", grammar.param, "invalid_value")
    if len(grammar.spec.source.encode()) > MAX_GRAMMAR_BYTES:
        raise OpenAIError(
            400,
            f"{grammar.param} is longer than {MAX_GRAMMAR_BYTES} bytes",
            grammar.param,
            "invalid_value",
        )
    return grammar


def grammar_param(fields: OpenAISampling | NativeSamplingParams) -> str:
    """The field a request's grammar came from (for a 400 that names it)."""
    grammar = request_grammar(fields)
    return grammar.param if grammar is not None else "response_format"


def _response_format_spec(response_format: object) -> GrammarSpec:
    kind = getattr(response_format, "type", None)
    if kind == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT)
    json_schema = getattr(response_format, "json_schema", None)
    schema = getattr(json_schema, "schema_", None) if json_schema is not None else None
    if schema is None:
        raise OpenAIError(
            400,
            "response_format json_schema needs json_schema.schema",
            "response_format",
            "invalid_value",
        )
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema, ensure_ascii=False))
