"""ModelConfig: the architecture facts kvstrata needs from a Hugging Face `config.json`
(and `generation_config.json`), validated once so the model code can trust them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvstrata.model.gguf_dir import resolve_model_dir
from kvstrata.model.layers import RopeScaling
from kvstrata.model.model_dir import read_json, sliding_window

# architecture -> (q/k/v bias forced on, per-head q/k RMSNorm). Qwen2 always has q/k/v
# biases and its config has no `attention_bias` key; the others read that key.
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: torch.dtype
    # Mistral-style sliding window. kvstrata attends over the full context, which equals
    # windowed attention only for sequences no longer than the window: see max_context_len.
    sliding_window: int | None = None

    @property
    def max_context_len(self) -> int:
        """Longest sequence (prompt + output) this model can serve exactly."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @staticmethod
    def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
        """Parse a `config.json` dict. Raises ValueError naming any unsupported or missing
        field."""
        architectures = hf.get("architectures") or []
        if not architectures:
            raise ValueError("config.json has no 'architectures' entry")
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        bias_forced, qk_norm = SUPPORTED_ARCHITECTURES[architecture]
        _refuse_unsupported_features(hf, architecture)

        hidden_size = _required(hf, "hidden_size", int)
        num_heads = _required(hf, "num_attention_heads", int)
        num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
        head_dim = int(hf.get("head_dim") or 0) or hidden_size // num_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        rope_theta, rope_scaling = _rope_fields(hf)
        window = sliding_window(hf)
        return ModelConfig(
            architecture=architecture,
            vocab_size=_required(hf, "vocab_size", int),
            hidden_size=hidden_size,
            intermediate_size=_required(hf, "intermediate_size", int),
            num_layers=_required(hf, "num_hidden_layers", int),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_required(hf, "max_position_embeddings", int),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bias_forced or bool(hf.get("attention_bias", False)),
            qk_norm=qk_norm,
            eos_token_ids=_token_ids(hf.get("eos_token_id")),
            bos_token_id=hf.get("bos_token_id"),
            torch_dtype=_dtype(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
            sliding_window=window,
        )

    @staticmethod
    def from_dir(model_dir: str | Path) -> ModelConfig:
        """Read `config.json`; eos ids from `generation_config.json`, when present, are
        added to the config's (instruct models often list their end-of-turn token there).
        A .gguf file stands for its model directory (gguf_dir.resolve_model_dir)."""
        model_dir = resolve_model_dir(model_dir)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model directory {model_dir} does not exist")
        hf = read_json(model_dir / "config.json")
        config = ModelConfig.from_hf_config(hf)
        generation_path = model_dir / "generation_config.json"
        if generation_path.is_file():
            extra_eos = _token_ids(read_json(generation_path).get("eos_token_id"))
            eos_ids = config.eos_token_ids + tuple(
                i for i in extra_eos if i not in config.eos_token_ids
            )
            config = replace(config, eos_token_ids=eos_ids)
        return config


def _required(hf: dict[str, Any], key: str, kind: type) -> Any:
    if hf.get(key) is None:
        raise ValueError(f"config.json is missing required field {key!r}")
    return kind(hf[key])


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(i) for i in value)


def _dtype(name: str) -> torch.dtype:
    name = name.removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported torch_dtype {name!r}; supported: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _rope_fields(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling from either layout: transformers 4 (`rope_theta` and
    `rope_scaling` at top level) or 5 (both inside `rope_parameters`)."""
    rope_parameters = hf.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in rope_parameters.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    rope_theta = rope_parameters.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = rope_parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported (only 1.0)")
    scaling = hf.get("rope_scaling") or rope_parameters
    return float(rope_theta), RopeScaling.from_hf(scaling)


def _refuse_unsupported_features(hf: dict[str, Any], architecture: str) -> None:
    hidden_act = hf.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {hidden_act!r} (only 'silu')")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if hf.get("use_sliding_window"):
        raise ValueError(f"use_sliding_window=true is not supported for {architecture}")
    if hf.get("quantization_config"):
        raise ValueError("quantized checkpoints (quantization_config) are not supported")
