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
    TORCH_OPS,
    GatedMLP,
    LMHead,
    ModelOps,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    merge_linears,
    project_to_vocab,
)
from kvstrata.model.tp import SINGLE, Collectives

if TYPE_CHECKING:
    from kvstrata.attention.base import BoundAttention


class Attention(nn.Module):
    """Projects q/k/v, applies q/k norm (Qwen3) and RoPE, hands the paged attention
    backend one layer's work, and projects the result back to the hidden size."""

    ops: ModelOps = TORCH_OPS
    tp: Collectives = SINGLE  # o_proj holds this worker's heads' rows: partial sums

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
        self.qkv_sizes = (config.q_size, config.kv_size, config.kv_size)
        self.qkv_proj: nn.Linear | None = None  # [q | k | v], see merge_projections

    def merge_projections(self) -> None:
        """Replace q/k/v by one [q | k | v] projection (after loading weights)."""
        self.qkv_proj = merge_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: BoundAttention
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        linear = self.ops.linear
        if self.qkv_proj is not None:  # strided views of one output; kernels take strides
            qkv = linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
            q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        else:
            q = linear(x, self.q_proj.weight, self.q_proj.bias)
            k = linear(x, self.k_proj.weight, self.k_proj.bias)
            v = linear(x, self.v_proj.weight, self.v_proj.bias)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q_weight = self.q_norm.weight if self.q_norm is not None else None
        k_weight = self.k_norm.weight if self.k_norm is not None else None
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        fused_store = self.ops.qk_norm_rope_store
        destination = attn.kv_destination(self.layer_id) if fused_store is not None else None
        if fused_store is not None and destination is not None:
            # norm per head, RoPE, and K/V straight into the cache: one kernel
            q = fused_store(q, k, v, q_weight, k_weight, eps, cos, sin, destination)
            out = attn(self.layer_id, q, None, None, self.scale)
        else:
            q, k = self.ops.qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)
            out = attn(self.layer_id, q, k, v, self.scale)
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        return self.tp.all_reduce(linear(out, self.o_proj.weight, None))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)).

    The residual stream travels as (x, delta): x before the previous block's output
    `delta` is added (None before the first layer), so each addition happens in the
    same kernel as the norm that follows it (`add_rms_norm`)."""

    ops: ModelOps = TORCH_OPS

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_id)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: BoundAttention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm = self.input_layernorm
        if delta is None:
            h = norm(x)
        else:
            x, h = self.ops.add_rms_norm(x, delta, norm.weight, norm.eps)
        attn_out = self.self_attn(h, cos, sin, attn)
        norm = self.post_attention_layernorm
        x, h = self.ops.add_rms_norm(x, attn_out, norm.weight, norm.eps)
        return x, self.mlp(h)


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm (HF's `model.` prefix)."""

    ops: ModelOps = TORCH_OPS

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
        x, delta = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, delta = layer(x, delta, cos, sin, attn)
        if delta is None:
            return self.norm(x)
        return self.ops.add_rms_norm(x, delta, self.norm.weight, self.norm.eps)[1]


class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head. Tied models have no `lm_head`: logits come from the
    embedding weight, so the two can never drift apart."""

    tp: Collectives = SINGLE

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size  # the whole vocabulary's (set_tp)
        self.model = LlamaModel(config)
        self.lm_head = (
            None if config.tie_word_embeddings else LMHead(config.vocab_size, config.hidden_size)
        )

    def set_ops(self, ops: ModelOps) -> None:
        """Route every layer's elementwise work through `ops` (the fused-kernel seam)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, DecoderLayer, GatedMLP, LlamaModel)):
                module.ops = ops

    def set_tp(self, tp: Collectives, vocab_start: int, vocab_size: int) -> None:
        """Make this model (built from `Shard.local_config`, loaded with `Shard.cut`) one
        worker of the group `tp`: its row-parallel projections and vocabulary rows
        (starting at `vocab_start`, of `vocab_size` in all) sum and gather over it."""
        self.tp, self.vocab_size = tp, vocab_size
        for module in self.modules():
            if isinstance(module, (Attention, GatedMLP)):
                module.tp = tp
            elif isinstance(module, VocabEmbedding):
                module.tp, module.vocab_start = tp, vocab_start

    def merge_projections(self) -> None:
        """Merge q/k/v and gate/up into one GEMM each (a speed trick on GPUs, where a
        batch-1 decode reads every weight once; parameter names change, so only call it
        after loading)."""
        for module in list(self.modules()):
            if isinstance(module, (Attention, GatedMLP)):
                module.merge_projections()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: BoundAttention
    ) -> torch.Tensor:
        """input_ids, positions: int64 [num_tokens] of a flattened batch (the layout
        `attn.meta` describes) -> final hidden states [num_tokens, hidden_size]."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> fp32 logits [n, vocab_size] (every worker's rows, less the
        last worker's padding)."""
        if self.lm_head is None:
            logits = project_to_vocab(hidden, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last(logits)[:, : self.vocab_size]
