"""The per-token costs measured on one H200 with qwen3-8b shapes: the defaults of the
router's `ttft` policy and of `kvstrata simulate`."""

from __future__ import annotations

# Per-token costs measured on one H200 with qwen3-8b shapes (bf16, page 16; docs/results.md,
# issues 4 and 7): the defaults of the `ttft` policy and of `kvstrata simulate`.
H200_KV_BYTES_PER_TOKEN = 147_456  # 2,359,296 bytes per page of all layers / 16 tokens
H200_PREFILL_TOKENS_PER_S = 41_700.0  # W1: 131,072 prompt tokens in 3.14 s of prefill steps
H200_L2_TOKENS_PER_S = 51.0e9 / H200_KV_BYTES_PER_TOKEN  # L2 -> L1 load-back, 51.0 GB/s
H200_L3_TOKENS_PER_S = 1.12e9 / H200_KV_BYTES_PER_TOKEN  # L3 file read, 1.12 GB/s
# A PD transfer between nodes (the reference design's setting) is bounded by the network;
# the pinned host-to-device peak (55.5 GB/s) stands in. On one host the ipc kernel moves
# 338 GB/s GPU to GPU (issue 10), and a host with several GPUs can pass that instead.
H200_TRANSFER_TOKENS_PER_S = 55.5e9 / H200_KV_BYTES_PER_TOKEN
