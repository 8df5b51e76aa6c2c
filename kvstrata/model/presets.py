"""Real shapes of released models, for random-weight benchmark models (`kvstrata
make-tiny-model --preset`); read without torch, so the CLI's parser loads none."""

from __future__ import annotations

from typing import Any

# Real shapes of released models (random weights): for benchmarks. Tied embeddings as in
# the release. The tiny tokenizer is kept: the model's vocabulary is larger than it.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
}
PRESET_COMMON: dict[str, Any] = {
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    "max_window_layers": 28,
}
