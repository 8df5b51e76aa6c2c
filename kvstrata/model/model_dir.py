"""What can be read of a model directory without torch (the router reads it): JSON files,
the GGUF suffix, and the longest context the model serves exactly (ModelConfig's rule,
from config.json alone)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GGUF_SUFFIX = ".gguf"


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def sliding_window(hf: dict[str, Any]) -> int | None:
    """The attention window kvstrata honours: Mistral's; Qwen's is used only with
    use_sliding_window, which ModelConfig refuses."""
    architectures = hf.get("architectures") or [None]
    window = hf.get("sliding_window") if architectures[0] == "MistralForCausalLM" else None
    return int(window) if window else None


def context_len(hf: dict[str, Any]) -> int:
    """Longest sequence (prompt + output) the model serves exactly: windowed attention
    equals full attention only within the window."""
    max_position_embeddings = int(hf["max_position_embeddings"])
    window = sliding_window(hf)
    return max_position_embeddings if window is None else min(max_position_embeddings, window)
