"""What a constrained request's output must match: a grammar's kind and text (the engine
compiles it, engine/grammar_compiler.py). Re-exported by core.py."""

from __future__ import annotations

import enum
from dataclasses import dataclass

MAX_GRAMMAR_BYTES = 64 << 10  # the most text a grammar (a JSON schema included) may have


class GrammarKind(str, enum.Enum):
    """What a constrained request's output must match (SGLang's sampling_params names)."""

    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # JSON valid against the schema in `source`
    REGEX = "regex"
    EBNF = "ebnf"  # an EBNF grammar (GBNF dialect), its rule `root` the whole output
    # Tool calls in a format (http/tool_prompt.py): JSON {"format", "calls", "parallel"}
    TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar by its text: two requests with equal specs share one compiled grammar."""

    kind: GrammarKind
    source: str = ""  # empty for JSON_OBJECT
