"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5 with q/k/v bias, Qwen3 with
per-head q/k RMSNorm) over a flattened batch of tokens and a paged attention backend.

Module and parameter names follow the Hugging Face checkpoints (`model.layers.N.self_attn.
q_proj.weight`, ...) so the loader maps tensors by name without a translation table."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kvstrata.model.config import ModelConfig
from kvstrata.model.layers import (
    GatedMLP,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    apply_rotary,
    project_to_vocab,
)

if TYPE_CHECKING:
    from kvstrata.attention.base import BoundAttention


class Attention(nn.Module):
    """Projects q/k/v, applies q/k norm (Qwen3) and RoPE, hands the paged attention
    backend one layer's work, and projects the result back to the hidden size."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_size, bias=bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: BoundAttention
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, before RoPE
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attn(self.layer_id, q, k, v, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_id)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: BoundAttention
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: BoundAttention
    ) -> torch.Tensor:
        cos, sin = self.rotary_emb.cos_sin(positions)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head. Tied models have no `lm_head`: logits come from the
    embedding weight, so the two can never drift apart."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = (
            None if config.tie_word_embeddings else LMHead(config.vocab_size, config.hidden_size)
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: BoundAttention
    ) -> torch.Tensor:
        """input_ids, positions: int64 [num_tokens] of a flattened batch (the layout
        `attn.meta` describes) -> final hidden states [num_tokens, hidden_size]."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> fp32 logits [n, vocab_size]."""
        if self.lm_head is None:
            return project_to_vocab(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)
