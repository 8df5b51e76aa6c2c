"""Device, stream and dtype resolution, the rank's MPS priority, and L1 pool sizing: how
many KV pages fit."""

from __future__ import annotations

import logging
import os

import torch

from kvstrata.config import ConfigError, EngineConfig
from kvstrata.kvcache.kv_scales import is_fp8
from kvstrata.kvcache.pages import KVPool
from kvstrata.model.config import ModelConfig

logger = logging.getLogger("kvstrata.engine")
MPS_PRIORITY_ENV = "CUDA_MPS_CLIENT_PRIORITY"
MPS_SM_PERCENT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
_MPS_PRIORITIES = {"normal": "0", "below_normal": "1"}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """The device `name` names, with an explicit index on CUDA (`cuda` is the current
    device): kernels and graphs run on the current device, so the engine binds it."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) present"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def apply_mps_priority(config: EngineConfig) -> str:
    """Set this process's MPS client priority (`--mps-client-priority`) and, on a prefill
    rank, its SM share (`--mps-prefill-sm-percent`) for the CUDA context it is about to
    create; its TP workers inherit both. `auto` leaves a priority the environment already
    gives. Returns the priority in effect."""
    sm_percent = config.speed.mps_prefill_sm_percent
    if config.pd.mode == "prefill" and sm_percent < 100:
        os.environ[MPS_SM_PERCENT_ENV] = str(sm_percent)
    choice = config.speed.mps_client_priority
    if choice == "auto":
        if MPS_PRIORITY_ENV in os.environ:
            return os.environ[MPS_PRIORITY_ENV]
        choice = "below_normal" if config.pd.mode == "prefill" else "normal"
    os.environ[MPS_PRIORITY_ENV] = _MPS_PRIORITIES[choice]
    if torch.cuda.is_initialized():
        logger.warning(
            "--mps-client-priority %s comes too late: CUDA already started in this process",
            choice,
        )
    return _MPS_PRIORITIES[choice]


def bind_device(device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
    """Make `device` and its `stream` (None: the default stream) current on the calling
    thread (CUDA's current device and stream are per thread; Triton kernels, streams and
    graph captures use them). No-op on CPU."""
    # Unconditional: torch may report a device as current that CUDA has not switched to
    # yet (an index parked by a device guard), so comparing first can skip a real switch.
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # Always set: another engine on this thread may have left its own stream current.
        torch.cuda.set_stream(stream if stream is not None else torch.cuda.default_stream(device))


def make_compute_stream(config: EngineConfig, device: torch.device) -> torch.cuda.Stream | None:
    """The stream of `--compute-stream` (None: the default stream), ordered after the work
    already queued on the current one (the weight loads, the pool, the graph captures)."""
    if device.type != "cuda" or config.speed.compute_stream == "default":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def resolve_dtype(name: str, device: torch.device, model: ModelConfig) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if model.torch_dtype == torch.float32 else model.torch_dtype


_KV_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pool's dtype (`--kv-cache-dtype`; auto: the model's). fp8 values are written
    divided by their layer's scale with a saturating cast and read back into the compute
    dtype times the scale. On CUDA the fp8 conversions need compute capability 8.9+."""
    kv_dtype = model_dtype if name == "auto" else _KV_DTYPES[name]
    if is_fp8(kv_dtype) and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ConfigError(
                f"--kv-cache-dtype {name}: fp8 KV needs a GPU of compute capability 8.9 or "
                f"newer (Ada, Hopper); this one is {major}.{minor}"
            )
    return kv_dtype


def page_bytes(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    return KVPool.page_bytes_for(
        config.pool.page_size, model.num_layers, model.num_kv_heads, model.head_dim, dtype
    )


ACTIVATION_MARGIN_BYTES = 2 << 30  # CUDA graph pools, cuBLAS workspaces, fragmentation


def activation_reserve_bytes(config: EngineConfig, model: ModelConfig) -> int:
    """GPU memory kept out of the KV pool for one step's transient tensors: an upper
    bound on the live activations of `max_num_batched_tokens` tokens (counted at 4 bytes
    an element, for the fp32 upcasts in norms and RoPE), the sampled rows' fp32 logits
    with room for sampling temporaries, and a fixed margin."""
    per_token_elems = (
        4 * model.hidden_size  # residual, normed input, attention out, MLP out
        + 3 * model.intermediate_size  # gate, up, silu(gate) * up
        + 2 * (model.q_size + 2 * model.kv_size)  # q/k/v and their normed/rotated copies
        + 2 * model.head_dim  # fp32 cos/sin
    )
    activations = config.scheduler.max_num_batched_tokens * per_token_elems * 4
    logits = 3 * config.scheduler.max_num_seqs * model.vocab_size * 4
    return activations + logits + ACTIVATION_MARGIN_BYTES


def num_l1_pages(
    config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device
) -> int:
    """Pages of the L1 pool: `--num-kv-pages` if given, else `--kv-cache-size-gb` on CPU,
    else what `--mem-fraction-static` of the GPU leaves after the weights and the
    activation reserve (call after loading the model)."""
    if config.pool.num_kv_pages is not None:
        return config.pool.num_kv_pages
    bytes_per_page = page_bytes(config, model, dtype)
    if device.type == "cpu":
        kv_bytes = int(config.pool.kv_cache_size_gb * (1 << 30))
    else:
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        used_bytes = total_bytes - free_bytes
        kv_bytes = (
            int(total_bytes * config.pool.mem_fraction_static)
            - used_bytes
            - activation_reserve_bytes(config, model)
        )
    num_pages = kv_bytes // bytes_per_page
    if num_pages < 1:
        raise ConfigError(
            "no room for a single KV page: raise --kv-cache-size-gb or --mem-fraction-static"
        )
    return num_pages
