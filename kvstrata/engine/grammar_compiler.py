"""`GrammarCompiler`: a request's grammar (`GrammarSpec`: a JSON schema, any JSON object, a
regex, an EBNF or tool calls in a format) compiled once per tokenizer with xgrammar, and
cached by its text; thread-safe, so the server compiles off the event loop and the engine
thread finds it compiled. A grammar that does not parse, is too large, or takes too long
to compile is refused (`GrammarError`, which names the problem: a 400)."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstrata.grammar_spec import MAX_GRAMMAR_BYTES, GrammarKind, GrammarSpec

if TYPE_CHECKING:
    from kvstrata.model.tokenizer import Tokenizer

COMPILE_TIMEOUT_S = 10.0
_MAX_CACHED = 512  # compiled grammars kept (each a few KiB to a few MiB)
# At most this many compiles run at once; more wait (a flood of new schemas cannot take
# every core). A compile past its timeout runs on (xgrammar cannot be interrupted) but
# its request is refused, and its slot is taken until it ends.
_COMPILE_THREADS = 2


class GrammarError(ValueError):
    """The grammar cannot be used: invalid, too large, or too slow to compile."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar ready for matchers (opaque outside this module and grammar.py)."""

    spec: GrammarSpec
    handle: Any  # xgrammar.CompiledGrammar


class GrammarCompiler:
    """One per engine (its tokenizer and vocabulary size). `compile` is safe from any
    thread; compiled grammars are shared by every request that names the same text."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        vocab = tokenizer.vocab_by_id()
        info = xgr.TokenizerInfo(
            vocab,
            xgr.VocabType[tokenizer.byte_encoding.upper()],  # BYTE_LEVEL, BYTE_FALLBACK, RAW
            vocab_size=max(vocab_size, len(vocab)),
            stop_token_ids=list(eos_token_ids),
            add_prefix_space=tokenizer.adds_prefix_space,
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._pending: dict[GrammarSpec, Any] = {}  # spec -> its compile's future
        self.num_compiles = 0

    def compile(self, spec: GrammarSpec, timeout_s: float = COMPILE_TIMEOUT_S) -> CompiledGrammar:
        """The compiled grammar of `spec` (cached); raises GrammarError."""
        if len(spec.source.encode()) > MAX_GRAMMAR_BYTES:
            raise GrammarError(
                f"the {spec.kind.value} is {len(spec.source.encode())} bytes; at most "
                f"{MAX_GRAMMAR_BYTES} are accepted"
            )
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
            future = self._pending.get(spec)
            if future is None:
                future = self._pending[spec] = self._pool.submit(self._compile, spec)
        try:
            handle = future.result(timeout=timeout_s)
        except FutureTimeout:
            raise GrammarError(
                f"the {spec.kind.value} did not compile within {timeout_s:g} s"
            ) from None
        finally:
            if future.done():
                with self._lock:
                    self._pending.pop(spec, None)
        compiled = CompiledGrammar(spec, handle)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > _MAX_CACHED:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> Any:
        self.num_compiles += 1
        compiler, kind = self._compiler, spec.kind
        try:
            if kind is GrammarKind.JSON_OBJECT:  # an object (xgrammar's builtin takes arrays)
                return compiler.compile_grammar(self._json_schema_ebnf('{"type": "object"}'))
            if kind is GrammarKind.JSON_SCHEMA:
                return compiler.compile_grammar(self._json_schema_ebnf(spec.source))
            if kind is GrammarKind.REGEX:
                return compiler.compile_regex(spec.source)
            if kind is GrammarKind.TOOL_CALLS:
                return compiler.compile_grammar(self._tool_calls_ebnf(spec.source))
            return compiler.compile_grammar(spec.source)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with its reason
            raise GrammarError(f"invalid {kind.value}: {_first_line(e)}") from None

    def _json_schema_ebnf(self, source: str) -> str:
        """The schema as EBNF, compact (no free whitespace: a weak model's whitespace loop
        cannot run to max_tokens), with xgrammar 0.2's length-bounded strings mended: their
        character class admits unescaped U+0000-U+001F, which JSON forbids (xgrammar issue
        #800; its own unbounded strings exclude them)."""
        grammar = self._xgr.Grammar.from_json_schema(
            _json_schema_text(source), any_whitespace=False, strict_mode=True
        )
        return str(grammar).replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)

    def _tool_calls_ebnf(self, source: str) -> str:
        """Calls of the given functions, in the format's own syntax: `hermes`, tagged
        blocks (one, or several on lines of their own); `llama3_json`, one bare object.
        Each call is {"name": one of the names, "arguments" (hermes) / "parameters": an
        object valid against that function's schema}."""
        try:
            request = json.loads(source)
            fmt, calls, parallel = request["format"], request["calls"], bool(request["parallel"])
            key = "arguments" if fmt == "hermes" else "parameters"
            one_call = {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"const": call["name"]}, key: call["parameters"]},
                        "required": ["name", key],
                        "additionalProperties": False,
                    }
                    for call in calls
                ]
            }
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise GrammarError(f"invalid tool_calls grammar: {e!r}") from None
        json_rules = _renamed_root(self._json_schema_ebnf(json.dumps(one_call)), "tool_json")
        if fmt == "hermes":
            tail = ' ("\\n" call)*' if parallel else ""
            return (
                f"{json_rules}\n"
                f'call ::= "<tool_call>\\n" tool_json "\\n</tool_call>"\n'
                f"root ::= call{tail}\n"
            )
        if fmt == "llama3_json":
            return f"{json_rules}\nroot ::= tool_json\n"
        raise GrammarError(f"unknown tool call format {fmt!r}")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# A length-bounded JSON string's character in xgrammar 0.2's EBNF, and JSON's own.
_BOUNDED_STRING_CHAR = r"([^\"\\\r\n])"
_JSON_STRING_CHAR = r"([^\0-\x1f\"\\\r\n])"


def _json_schema_text(source: str) -> str:
    """The schema as JSON text, refused unless it is a JSON object (or true)."""
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as e:
        raise GrammarError(f"the JSON schema is not JSON: {e}") from None
    if schema is True:
        return "{}"
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be a JSON object")
    return source


_EBNF_PIECE = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][\w-]*|.', re.S)


def _renamed_root(ebnf: str, name: str) -> str:
    """`ebnf` with its rule `root` (its definition and every use) called `name`; string
    literals and character classes (a property named "root") are left as they are."""
    return "".join(name if piece == "root" else piece for piece in _EBNF_PIECE.findall(ebnf))


def _first_line(error: Exception) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:300]
