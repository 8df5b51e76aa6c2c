"""Text <-> token ids for a Hugging Face model directory (`tokenizer.json` plus
`tokenizer_config.json`), chat templates rendered with jinja2, and the incremental
detokenizer that streaming and stop strings use."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvstrata.model.gguf_dir import resolve_model_dir
from kvstrata.model.model_dir import read_json

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A model directory's tokenizer. `eos_token_ids` are the tokenizer's eos token plus
    any listed in `generation_config.json`; `decode` skips special tokens by default, as
    a server's output text should. A .gguf file stands for its model directory."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = resolve_model_dir(model_dir)
        tokenizer_path = model_dir / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise FileNotFoundError(f"{tokenizer_path} not found")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(tokenizer_path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"cannot read {tokenizer_path}: {e}") from e
        config_path = model_dir / "tokenizer_config.json"
        tok_config = read_json(config_path) if config_path.is_file() else {}
        self.bos_token = _token_text(tok_config.get("bos_token"))
        self.eos_token = _token_text(tok_config.get("eos_token"))
        self.chat_template = _find_chat_template(model_dir, tok_config)
        self._template: jinja2.Template | None = None
        if self.chat_template is not None:
            try:
                self._template = _jinja_env().from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"chat template of {model_dir} does not parse: {e}") from e

        eos_ids: list[int] = []
        eos_id = self.token_to_id(self.eos_token) if self.eos_token is not None else None
        if eos_id is not None:
            eos_ids.append(eos_id)
        generation_path = model_dir / "generation_config.json"
        if generation_path.is_file():
            extra = read_json(generation_path).get("eos_token_id")
            for token_id in [extra] if isinstance(extra, int) else extra or []:
                if token_id not in eos_ids:
                    eos_ids.append(int(token_id))
        self.eos_token_ids: tuple[int, ...] = tuple(eos_ids)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added special tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab_by_id(self) -> list[str]:
        """Each token id's token as the vocabulary spells it (byte-level tokens as their
        mapped characters); ids with no token get "" (never produced by a grammar)."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        tokens = [""] * (max(vocab.values(), default=-1) + 1)
        for token, token_id in vocab.items():
            tokens[token_id] = token
        return tokens

    @functools.cached_property
    def byte_encoding(self) -> str:
        """How tokens spell bytes: "byte_level" (GPT-2's byte-to-character map),
        "byte_fallback" (SentencePiece's <0xNN> tokens) or "raw" (tokens are text)."""
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        parts = (
            decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
        )
        types = {part.get("type") for part in parts}
        if "ByteLevel" in types:
            return "byte_level"
        return "byte_fallback" if "ByteFallback" in types else "raw"

    @functools.cached_property
    def adds_prefix_space(self) -> bool:
        """Whether encoding prepends a space to the first word (Metaspace, ByteLevel)."""
        pre = json.loads(self._tok.to_str()).get("pre_tokenizer") or {}
        parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
        return any(part.get("add_prefix_space") for part in parts)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Like HF `tokenizer(text)`: the tokenizer's post-processor may add a BOS."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """The chat template applied to `messages` (and `variables`: `tools`, ...), as text."""
        if self._template is None:
            raise ValueError(
                "this model has no chat template (no 'chat_template' in tokenizer_config.json "
                "and no chat_template.jinja); use a completions prompt instead"
            )
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **variables,
        )

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> list[int]:
        # The template writes any BOS itself, so the post-processor must not add another.
        text = self.render_chat(messages, add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False)


class IncrementalDecoder:
    """Turns a growing list of output ids into text deltas for streaming.

    Invariant: the concatenation of every `step` result and the final `flush` equals
    `tokenizer.decode(output_ids)`. Text is only emitted once it cannot change: a token
    that ends inside a multi-byte UTF-8 character decodes to '\\ufffd', so the delta is
    held back until a later token completes the character. Decoding restarts from a
    window [prefix_offset, len) so each step costs O(window), not O(output length)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        # ids[prefix_offset:read_offset] decode to text already emitted; ids[read_offset:]
        # are the tokens whose text is still pending.
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # everything emitted so far

    def step(self, output_ids: Sequence[int]) -> str:
        """Feed all output ids so far (a superset of the last call's); return new text."""
        if len(output_ids) < len(self._ids):
            raise ValueError("output ids shrank; IncrementalDecoder only follows growth")
        self._ids.extend(output_ids[len(self._ids) :])
        emitted = self._decode(self._prefix_offset, self._read_offset)
        current = self._decode(self._prefix_offset, len(self._ids))
        if len(current) <= len(emitted) or current.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or the last character is not complete yet
        delta = current[len(emitted) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: the held-back text, incomplete characters included."""
        emitted = self._decode(self._prefix_offset, self._read_offset)
        delta = self._decode(self._prefix_offset, len(self._ids))[len(emitted) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self._ids[start:end], self._skip_special_tokens)


def _token_text(token: str | dict[str, Any] | None) -> str | None:
    # Special tokens are stored either as plain strings or as serialised AddedToken dicts.
    if isinstance(token, dict):
        return token.get("content")
    return token


def _find_chat_template(model_dir: Path, tok_config: dict[str, Any]) -> str | None:
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    if template:
        return template
    # Newer exports keep the template in a file of its own.
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8")
    json_path = model_dir / "chat_template.json"
    if json_path.is_file():
        return read_json(json_path).get("chat_template")
    return None


def _jinja_env() -> jinja2.Environment:
    # The conventions chat templates are written against: trimmed blocks, loop controls,
    # a `raise_exception` helper, `strftime_now` and a non-ASCII-escaping `tojson`.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
