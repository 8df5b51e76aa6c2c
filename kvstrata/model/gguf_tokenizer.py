"""The Hugging Face tokenizer files of a GGUF checkpoint, built from its `tokenizer.ggml.*`
metadata: a byte-level BPE `tokenizer.json` (with the pre-tokenizer llama.cpp's `pre`
name stands for) and the `tokenizer_config.json` the chat template reads."""

from __future__ import annotations

from typing import Any

from kvstrata.model.gguf import GgufCheckpoint, GgufError

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Splitting regexes of the pre-tokenizers these names stand for in llama.cpp (each the
# same as the original model's tokenizer.json).
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": use_regex,
    }


def _split_then_bytes(regex: str) -> dict[str, Any]:
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, _byte_level(use_regex=False)]}


# tokenizer.ggml.pre -> the pre-tokenizer. `smollm`: every digit on its own, then GPT-2's
# byte-level split (SmolLM's own tokenizer.json; llama.cpp's regex for it says the same).
PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "default": _byte_level(use_regex=True),
    "gpt-2": _byte_level(use_regex=True),
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            _byte_level(use_regex=True),
        ],
    },
    "llama-bpe": _split_then_bytes(_LLAMA3_REGEX),
    "qwen2": _split_then_bytes(_QWEN2_REGEX),
}


def tokenizer_json(checkpoint: GgufCheckpoint) -> dict[str, Any]:
    """A `tokenizers` JSON document equal in behaviour to the file's tokenizer."""
    kind = checkpoint.field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GgufError(
            f"{checkpoint.path}: tokenizer model {kind!r} is not supported (only 'gpt2', "
            "byte-level BPE; SentencePiece 'llama' vocabularies are not)"
        )
    pre = checkpoint.field("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GgufError(
            f"{checkpoint.path}: pre-tokenizer {pre!r} is not supported; supported: "
            f"{', '.join(PRE_TOKENIZERS)}"
        )
    tokens: list[str] = checkpoint.field("tokenizer.ggml.tokens")
    types: list[int] = checkpoint.field("tokenizer.ggml.token_type", [1] * len(tokens))
    merges: list[str] = checkpoint.field("tokenizer.ggml.merges")
    added = [
        {
            "id": i,
            "content": tokens[i],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": types[i] == _CONTROL,
        }
        for i in range(len(tokens))
        if types[i] in (_CONTROL, _USER_DEFINED)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        "post_processor": _post_processor(checkpoint, tokens),
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": pre == "llama-bpe",
            "vocab": {token: i for i, token in enumerate(tokens)},
            "merges": [merge.split(" ", 1) for merge in merges],
        },
    }


def tokenizer_config(checkpoint: GgufCheckpoint) -> dict[str, Any]:
    """bos/eos token texts (a chat template may print them)."""
    tokens: list[str] = checkpoint.field("tokenizer.ggml.tokens")
    config: dict[str, Any] = {}
    for key in ("bos", "eos", "unknown", "padding"):
        token_id = checkpoint.field(f"tokenizer.ggml.{key}_token_id", None)
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            name = {"unknown": "unk", "padding": "pad"}.get(key, key)
            config[f"{name}_token"] = tokens[int(token_id)]
    return config


def _post_processor(checkpoint: GgufCheckpoint, tokens: list[str]) -> dict[str, Any] | None:
    """A BOS in front of every encoded text when the file asks for one."""
    bos_id = checkpoint.field("tokenizer.ggml.bos_token_id", None)
    if not checkpoint.field("tokenizer.ggml.add_bos_token", False) or bos_id is None:
        return None
    bos = tokens[int(bos_id)]
    return {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [int(bos_id)], "tokens": [bos]}},
    }
