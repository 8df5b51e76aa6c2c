"""GgufCheckpoint: one GGUF file (llama.cpp's single-file format) of a Llama-family model,
read with the `gguf` package: its architecture facts as a Hugging Face config dict and its
tensors under Hugging Face names, dequantized into a torch dtype."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

# GGUF `general.architecture` -> (Hugging Face architecture, whether llama.cpp's converter
# permuted the q/k rows). llama.cpp converts MistralForCausalLM as `llama` too. For
# `llama` the converter reorders each head's q/k rows from HF's rotate-half RoPE layout
# (first half | second half) to interleaved pairs; Qwen keeps HF's layout (neox RoPE).
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

# Tensor types this loader dequantizes (all through `gguf.quants.dequantize`).
SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")
_MISSING = object()


class GgufError(ValueError):
    """A GGUF file kvstrata cannot load; the message names what is unsupported."""


class GgufCheckpoint:
    """Opens the file once (tensor data stays memory-mapped until `read` is called)."""

    def __init__(self, path: str | Path) -> None:
        import gguf  # only GGUF users need the package

        self.path = Path(path)
        try:
            self._reader = gguf.GGUFReader(self.path)
        except (OSError, ValueError, IndexError) as e:
            raise GgufError(f"cannot read GGUF file {self.path}: {e}") from e
        self.arch = str(self.field("general.architecture"))
        if self.arch not in ARCHITECTURES:
            raise GgufError(
                f"{self.path}: unsupported GGUF architecture {self.arch!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        self.hf_architecture, self._permuted_qk = ARCHITECTURES[self.arch]
        self._tensors = {_hf_name(t.name, self.path): t for t in self._reader.tensors}
        for name, tensor in self._tensors.items():
            if tensor.tensor_type.name not in SUPPORTED_TYPES:
                raise GgufError(
                    f"{self.path}: tensor {tensor.name} ({name}) has quantization type "
                    f"{tensor.tensor_type.name}, which kvstrata cannot load; supported: "
                    f"{', '.join(SUPPORTED_TYPES)}"
                )

    def field(self, key: str, default: Any = _MISSING) -> Any:
        """A metadata value (arrays as lists); `default` when absent, else GgufError."""
        field = self._reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise GgufError(f"{self.path}: GGUF metadata has no {key!r}")
            return default
        return field.contents()

    def arch_field(self, key: str, default: Any = _MISSING) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    def hf_config(self) -> dict[str, Any]:
        """The `config.json` this checkpoint would have had (ModelConfig.from_hf_config
        validates it like any other)."""
        num_heads = int(self.arch_field("attention.head_count"))
        hidden_size = int(self.arch_field("embedding_length"))
        head_dim = int(self.arch_field("attention.key_length", hidden_size // num_heads))
        rotary_dims = int(self.arch_field("rope.dimension_count", head_dim))
        if rotary_dims != head_dim:
            raise GgufError(
                f"{self.path}: partial RoPE ({rotary_dims} of {head_dim} dims) is not supported"
            )
        if "rope_freqs.weight" in self._tensors:
            raise GgufError(
                f"{self.path}: tensor rope_freqs.weight (llama3-style RoPE frequency factors) "
                "is not supported"
            )
        vocab_size = self.arch_field("vocab_size", None)
        if vocab_size is None:
            vocab_size = len(self.field("tokenizer.ggml.tokens"))
        return {
            "architectures": [self.hf_architecture],
            "vocab_size": int(vocab_size),
            "hidden_size": hidden_size,
            "intermediate_size": int(self.arch_field("feed_forward_length")),
            "num_hidden_layers": int(self.arch_field("block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(self.arch_field("attention.head_count_kv", num_heads)),
            "head_dim": head_dim,
            "rms_norm_eps": float(self.arch_field("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self.arch_field("rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(),
            "max_position_embeddings": int(self.arch_field("context_length")),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self._tensors,
            "hidden_act": "silu",
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id", None),
            # What the original checkpoints were trained in: the GPU default (CPU runs fp32).
            "torch_dtype": "bfloat16",
        }

    def generation_config(self) -> dict[str, Any]:
        """eos ids a generation stops at: the eos token and llama.cpp's end-of-turn token."""
        eos_ids = [self.field("tokenizer.ggml.eos_token_id", None)]
        eos_ids.append(self.field("tokenizer.ggml.eot_token_id", None))
        ids = list(dict.fromkeys(int(i) for i in eos_ids if i is not None))
        return {
            "eos_token_id": ids,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id", None),
        }

    def tensor_names(self) -> list[str]:
        """Hugging Face names of the stored tensors."""
        return list(self._tensors)

    def read(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Tensor `name` (HF name and HF layout), dequantized to `dtype` on `device`."""
        import gguf

        tensor = self._tensors[name]
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists ne0 first
        values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
        values = values.reshape(shape)
        if self._permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            num_heads = int(self.arch_field("attention.head_count"))
            if name.endswith("k_proj.weight"):
                num_heads = int(self.arch_field("attention.head_count_kv", num_heads))
            values = unpermute_rotary_rows(values, num_heads)
        # A copy: F32 tensors dequantize to views of the read-only memory map.
        return torch.from_numpy(np.array(values, order="C")).to(device=device, dtype=dtype)

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self.arch_field("rope.scaling.type", "none")
        if kind == "none":
            return None
        if kind != "linear":
            raise GgufError(f"{self.path}: RoPE scaling type {kind!r} is not supported in GGUF")
        return {"rope_type": "linear", "factor": float(self.arch_field("rope.scaling.factor"))}


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order. Per head, GGUF stores rows as interleaved pairs
    (r0 r_h, r1 r_h+1, ...) where HF stores [r0 .. r_h-1 | r_h .. r_2h-1] (h = head_dim/2):
    GGUF rows viewed as [heads, h, 2] are HF rows viewed as [heads, 2, h], swapped."""
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def permute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of `unpermute_rotary_rows` (HF -> GGUF order; tests write GGUF files)."""
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, 2, half, cols).swapaxes(1, 2).reshape(rows, cols)


def _hf_name(gguf_name: str, path: Path) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    if gguf_name == "rope_freqs.weight":
        return gguf_name  # refused with its reason in hf_config
    raise GgufError(f"{path}: GGUF tensor {gguf_name!r} has no place in a Llama-family model")
