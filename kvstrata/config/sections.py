"""The sections of an engine's config that concern one part each: the model (`ModelOptions`),
the L1 pool (`PoolOptions`), the scheduler (`SchedulerOptions`) and the speed tricks
(`SpeedOptions`). Each field is a flag (`opt`, named by its `flag_name` where that differs)
and each section refuses its own bad values, naming the flag."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.config.options import ConfigError, check_choices, check_device, opt

KV_CACHE_DTYPES = (
    "auto",
    "bfloat16",
    "bf16",
    "float16",
    "fp16",
    "float32",
    "fp32",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
)


@dataclass(frozen=True)
class ModelOptions:
    """Which checkpoint, in what precision, on which device, in which page-hash namespace."""

    path: str = opt(
        "",
        "Model directory in Hugging Face layout (config.json + safetensors), or a .gguf file.",
        flag_name="model",
    )
    device: str = opt("auto", "Device: auto (cuda if present, else cpu), cpu, cuda or cuda:N.")
    dtype: str = opt(
        "auto",
        "Weight and KV dtype. auto: float32 on CPU, the checkpoint's dtype (bf16 if fp32) on CUDA.",
        ("auto", "float32", "bfloat16", "float16"),
    )
    kv_cache_dtype: str = opt(
        "auto",
        "KV cache dtype in every tier and on the PD wire. auto: the model's dtype; fp8 "
        "(= fp8_e4m3) and fp8_e5m2 store each value in one byte (twice the tokens per "
        "byte) divided by a per-layer scale: the checkpoint's k_scale/v_scale if it has "
        "them, else 1.0, or measured with --kv-scales-calibrate. On CUDA: compute "
        "capability 8.9+. Part of the page-hash namespace (with the scales): ranks of "
        "different KV dtypes or scales never share pages.",
        KV_CACHE_DTYPES,
    )
    kv_scales_calibrate: int = opt(
        0,
        "fp8 KV: measure each layer's K and V scales on the first N tokens of "
        "--kv-scales-text at start-up (largest |K|, |V| mapped onto the fp8 range); 0: off.",
    )
    kv_scales_text: str = opt(
        "", "A UTF-8 text file to calibrate the fp8 KV scales on (--kv-scales-calibrate)."
    )
    cache_salt: str = opt(
        "", "Extra namespace key for page hashes (e.g. a LoRA id): separates L3 contents."
    )
    tp_size: int = opt(
        1,
        "Tensor-parallel workers of this rank, one per device (CUDA: --device's index and "
        "the next ones; CPU: processes over gloo). Heads, MLP and vocabulary are split; "
        "one scheduler and server. So far unified ranks (L1, L2, L3).",
    )

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("--model is required")
        check_device(self.device, "--device")
        check_choices(self)
        if self.tp_size < 1:
            raise ConfigError(f"--tp-size must be >= 1, got {self.tp_size}")
        if self.kv_scales_calibrate < 0:
            raise ConfigError(f"--kv-scales-calibrate must be >= 0, got {self.kv_scales_calibrate}")
        if self.kv_scales_calibrate and not self.kv_cache_dtype.startswith("fp8"):
            raise ConfigError(
                "--kv-scales-calibrate applies to fp8 KV only; set --kv-cache-dtype fp8_e4m3 "
                f"or fp8_e5m2 (got --kv-cache-dtype {self.kv_cache_dtype})"
            )
        if self.kv_scales_calibrate and not self.kv_scales_text:
            raise ConfigError("--kv-scales-calibrate needs --kv-scales-text FILE to read")
        if self.kv_scales_text and not self.kv_scales_calibrate:
            raise ConfigError("--kv-scales-text is read only with --kv-scales-calibrate N > 0")


@dataclass(frozen=True)
class PoolOptions:
    """The L1 KV pool: its page size and how many pages it holds."""

    page_size: int = opt(16, "Tokens per KV page: the unit of allocation, caching and transfer.")
    kv_cache_size_gb: float = opt(1.0, "L1 KV pool size in GiB on CPU.")
    mem_fraction_static: float = opt(
        0.85, "On CUDA: fraction of GPU memory for weights plus the L1 KV pool."
    )
    num_kv_pages: int | None = opt(
        None, "Exact number of L1 KV pages (overrides the sizing flags)."
    )

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ConfigError(f"--page-size must be >= 1, got {self.page_size}")
        if self.kv_cache_size_gb <= 0:
            raise ConfigError(f"--kv-cache-size-gb must be > 0, got {self.kv_cache_size_gb}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigError(
                f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}"
            )
        if self.num_kv_pages is not None and self.num_kv_pages < 1:
            raise ConfigError(f"--num-kv-pages must be >= 1, got {self.num_kv_pages}")


@dataclass(frozen=True)
class SchedulerOptions:
    """What one step may hold, how long a sequence may grow, and the sampling seed."""

    max_model_len: int | None = opt(
        None, "Longest sequence (prompt + output) in tokens; default: the model's context."
    )
    max_num_batched_tokens: int = opt(8192, "Token budget of one engine step.")
    max_num_seqs: int = opt(256, "Most requests running at once.")
    enable_chunked_prefill: bool = opt(
        True, "Split long prompts across steps to fit the token budget."
    )
    seed: int = opt(0, "Seed for sampling requests that do not set their own.")

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")


@dataclass(frozen=True)
class SpeedOptions:
    """The speed tricks, each with its off switch (kernels, CUDA graphs, overlap, streams)."""

    attention_backend: str = opt(
        "auto", "Attention kernels: auto (triton on CUDA, else torch).", ("auto", "torch", "triton")
    )
    disable_cuda_graph: bool = opt(
        False, "On CUDA: run decode steps eagerly instead of replaying captured CUDA graphs."
    )
    cuda_graph_max_bs: int = opt(256, "Largest decode batch captured as a CUDA graph.")
    overlap_schedule: str = opt(
        "auto",
        "Greedy decode steps: launch step N+1 from step N's tokens on the device before "
        "reading them, so the host work of a step overlaps the GPU. auto: on with CUDA "
        "graphs; on; off.",
        ("auto", "on", "off"),
    )
    disable_fused_ops: bool = opt(
        False,
        "On CUDA: use the torch reference ops instead of fused Triton norm/RoPE/SiLU "
        "kernels and merged q/k/v and gate/up projections.",
    )
    disable_pdl: bool = opt(
        False,
        "On Hopper or later GPUs: launch the Triton kernels in plain stream order instead "
        "of with programmatic dependent launch (a kernel starting while the one before "
        "it drains).",
    )
    compute_stream: str = opt(
        "default",
        "CUDA stream of the engine's kernels: default (the legacy default stream) or own (a "
        "stream of the engine's own, which neither waits for the default stream nor holds "
        "it up; measured with the mooncake transport, where the Transfer Engine copies GPU "
        "memory on the default stream: streamed writes 6% faster, serial ones unchanged, "
        "docs/results.md).",
        ("default", "own"),
    )

    mps_client_priority: str = opt(
        "auto",
        "With several ranks on one GPU under MPS: this rank's scheduling priority against "
        "theirs (CUDA_MPS_CLIENT_PRIORITY, set before CUDA starts; no effect without MPS). "
        "auto: below_normal on a prefill rank, so a decode rank's steps run first and its "
        "tokens keep their pace while prompts compute beside them (docs/results.md, issue "
        "29); normal elsewhere.",
        ("auto", "normal", "below_normal"),
    )
    mps_prefill_sm_percent: int = opt(
        100,
        "With a prefill rank and a decode rank on one GPU under MPS: the share of the SMs "
        "a prefill rank's kernels may occupy (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, set "
        "before CUDA starts), so its long prompt kernels cannot hold every SM a decode "
        "step waits for. 100: no limit. Other roles ignore it; no effect without MPS.",
    )

    def __post_init__(self) -> None:
        if self.cuda_graph_max_bs < 1:
            raise ConfigError(f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")
        if not 1 <= self.mps_prefill_sm_percent <= 100:
            raise ConfigError(
                f"--mps-prefill-sm-percent must be in [1, 100], got {self.mps_prefill_sm_percent}"
            )
        check_choices(self)
