"""The lower bounds the offline benchmark reports against: bf16 matmul peak and HBM copy
bandwidth measured on the device, and the FLOP and byte counts of the workloads."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from kvstrata.model.config import ModelConfig


def measure_roofline() -> dict[str, float]:
    """bf16 matmul peak (8192^3, random data) and HBM copy bandwidth (bytes read + written),
    each the median of timed repeats after warm-up, with device events."""

    def median_ms(fn: Any, repeats: int) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    n = 8192
    a = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    flip = [0]

    def matmul() -> None:
        flip[0] ^= 1
        torch.mm(a[flip[0]], b)

    matmul_ms = median_ms(matmul, 20)
    src = torch.randn(1 << 30, device="cuda", dtype=torch.float32)  # 4 GiB
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), 10)
    return {
        "matmul_tflops": 2 * n**3 / (matmul_ms * 1e-3) / 1e12,
        "hbm_gbps": 2 * src.numel() * 4 / (copy_ms * 1e-3) / 1e9,
    }


def model_counts(config: ModelConfig) -> dict[str, float]:
    """Parameter and per-token counts used by the lower bounds."""
    h, layers = config.hidden_size, config.num_layers
    per_layer = h * (config.q_size + 2 * config.kv_size) + config.q_size * h
    per_layer += 3 * h * config.intermediate_size + 2 * h + 2 * config.head_dim
    head = config.vocab_size * h  # LM head (= the embedding when tied)
    return {
        "layer_params": per_layer * layers,
        "head_params": head,
        "embed_params": 0 if config.tie_word_embeddings else head,
        "kv_bytes_per_token": 2 * layers * config.kv_size * 2,  # bf16 K and V
    }


def w1_lower_bound_s(
    config: ModelConfig, roof: dict[str, float], num_prompts: int, prompt_len: int, output_len: int
) -> dict[str, float]:
    """Prefill FLOPs / matmul peak + decode bytes / HBM bandwidth, for W1-shaped work.
    Prefill: 2 * layer params per prompt token + causal attention + one LM-head row per
    prompt. Decode: every step reads all weights once (bf16; not the embedding table)
    plus the KV of every sequence."""
    counts = model_counts(config)
    num_tokens = num_prompts * prompt_len
    attn_flops = 4 * config.q_size * config.num_layers * num_prompts * prompt_len**2 / 2
    prefill_flops = 2 * counts["layer_params"] * num_tokens + attn_flops
    prefill_flops += 2 * counts["head_params"] * num_prompts
    weight_bytes = 2 * (counts["layer_params"] + counts["head_params"])
    decode_bytes = 0.0
    for step in range(1, output_len):  # the first token comes from the prefill
        context = prompt_len + step
        decode_bytes += weight_bytes + num_prompts * context * counts["kv_bytes_per_token"]
    prefill_s = prefill_flops / (roof["matmul_tflops"] * 1e12)
    decode_s = decode_bytes / (roof["hbm_gbps"] * 1e9)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "total_s": prefill_s + decode_s}


def w2_bound_ms(
    config: ModelConfig,
    roof: dict[str, float],
    context_len: int,
    output_len: int,
    kv_itemsize: int = 2,
) -> dict[str, float]:
    """Weights (bf16) and the KV read per decode step (`kv_itemsize` bytes a value: 1 for
    fp8 KV), over HBM bandwidth."""
    counts = model_counts(config)
    weight_bytes = 2 * (counts["layer_params"] + counts["head_params"])
    kv_bytes = (context_len + output_len // 2) * counts["kv_bytes_per_token"] * kv_itemsize // 2
    bandwidth = roof["hbm_gbps"] * 1e9
    return {
        "weights_ms": weight_bytes / bandwidth * 1e3,
        "weights_plus_kv_ms": (weight_bytes + kv_bytes) / bandwidth * 1e3,
    }
