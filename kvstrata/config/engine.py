"""`EngineConfig`: the options of one engine (model, KV pool, scheduler, cache tiers, PD
role and transport, speed tricks), each refused with a message naming its flag."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from kvstrata.config.cache import check_cache, fold_decode_aliases, hide_storage_key
from kvstrata.config.mooncake import MooncakeTransportConfig
from kvstrata.config.options import (
    ConfigError,
    check_choices,
    check_device,
    flag,
    key_file_opt,
    opt,
    resolve_key_files,
)
from kvstrata.config.secret import Secret


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine (model, KV pool, scheduler)."""

    model: str = opt(
        "", "Model directory in Hugging Face layout (config.json + safetensors), or a .gguf file."
    )
    device: str = opt("auto", "Device: auto (cuda if present, else cpu), cpu, cuda or cuda:N.")
    dtype: str = opt(
        "auto",
        "Weight and KV dtype. auto: float32 on CPU, the checkpoint's dtype (bf16 if fp32) on CUDA.",
        ("auto", "float32", "bfloat16", "float16"),
    )
    page_size: int = opt(16, "Tokens per KV page: the unit of allocation, caching and transfer.")
    kv_cache_size_gb: float = opt(1.0, "L1 KV pool size in GiB on CPU.")
    mem_fraction_static: float = opt(
        0.85, "On CUDA: fraction of GPU memory for weights plus the L1 KV pool."
    )
    num_kv_pages: int | None = opt(
        None, "Exact number of L1 KV pages (overrides the sizing flags)."
    )
    max_model_len: int | None = opt(
        None, "Longest sequence (prompt + output) in tokens; default: the model's context."
    )
    max_num_batched_tokens: int = opt(8192, "Token budget of one engine step.")
    max_num_seqs: int = opt(256, "Most requests running at once.")
    enable_chunked_prefill: bool = opt(
        True, "Split long prompts across steps to fit the token budget."
    )
    disable_radix_cache: bool | None = opt(
        None, "Turn the L1 prefix (radix) cache off. Default: on, but off on decode ranks "
        "(SGLang's default; --disaggregation-decode-enable-radix-cache turns it on there).",
    )  # fmt: skip
    radix_eviction_policy: str = opt("lru", "Eviction order of cached pages.", ("lru", "lfu"))
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
    seed: int = opt(0, "Seed for sampling requests that do not set their own.")
    # -- hierarchical cache (L2 host memory, L3 storage): every role, config/cache.py --
    enable_hierarchical_cache: bool = opt(
        False, "Back L1 with an L2 host-memory pool (and optionally L3 storage)."
    )
    hicache_ratio: float = opt(2.0, "L2 pages as a multiple of L1 pages.")
    hicache_size: float = opt(0.0, "L2 size in GiB; overrides --hicache-ratio when > 0.")
    hicache_write_policy: str = opt(
        "write_through",
        "When L1 pages are copied to L2.",
        ("write_through", "write_through_selective", "write_back"),
    )
    hicache_storage_backend: str = opt(
        "none", "L3 storage behind L2.", ("none", "file", "mooncake")
    )
    hicache_storage_dir: str = opt(
        "", "Directory of the `file` L3 backend (shared safely by several processes)."
    )
    hicache_storage_backend_extra_config: str = opt(
        "{}", "JSON options of the L3 backend (mooncake: master address, protocol, ...)."
    )
    # Held as a `Secret` once the config is made (never shown, /server_info included).
    hicache_storage_key: str | None = opt(
        None,
        "Secret that signs and checks every L3 page (HMAC-SHA256 under a key derived from "
        "it): ranks with the same secret read each other's pages; a page anyone else wrote "
        "or changed is refused and recomputed. Default: a served rank's cluster key; "
        "without one, for `file`, a key file the directory keeps (kvstrata-l3.key, made on "
        "first use), for `mooncake`, a key of the process's own (its pages serve it alone).",
        secret=True,
    )
    hicache_storage_key_file: str | None = key_file_opt("hicache_storage_key")
    hicache_storage_file_mode: str = opt(
        "private",
        "Who may use the `file` L3 directory: private (0600 page and key files in 0700 "
        "directories: this user's processes) or group (0640 files in 2770 directories: "
        "the directory's group, for ranks run by several users of it).",
        ("private", "group"),
    )
    hicache_storage_allow_shared_dir: bool = opt(
        False,
        "Use a `file` L3 directory that another user owns or other users may write, "
        "refused by default (they could delete or replace pages and plant a key file). "
        "Pages are still used only when their MAC verifies.",
    )
    hicache_storage_prefetch_policy: str = opt(
        "timeout",
        "How long admission waits for an L3 prefetch: not at all (best_effort: only what "
        "already arrived is used), until it completes, or a bounded time (timeout).",
        ("best_effort", "wait_complete", "timeout"),
    )
    hicache_prefetch_threshold: int = opt(
        256, "Prefetch from L3 only when at least this many tokens could come from it."
    )
    hicache_prefetch_timeout_base_s: float = opt(
        0.5, "`timeout` prefetch policy: base wait in seconds."
    )
    hicache_prefetch_timeout_per_1k_tokens_s: float = opt(
        0.25, "`timeout` prefetch policy: extra wait per 1,000 prefetched tokens."
    )
    hicache_io_threads: int = opt(4, "Worker threads for L3 reads and writes.")
    hicache_io_backend: str = opt(
        "auto",
        "L1<->L2 copies: kernel (one Triton launch, zero-copy, CUDA only), direct (torch "
        "indexing), auto (kernel on CUDA).",
        ("auto", "kernel", "direct"),
    )
    # -- PD disaggregation --
    disaggregation_mode: str = opt(
        "null",
        "null: a unified server; prefill or decode: one side of a PD pair.",
        ("null", "prefill", "decode"),
    )
    disaggregation_transfer_backend: str = opt(
        "ipc", "How prefill writes KV pages into decode ranks.", ("ipc", "mooncake")
    )
    disaggregation_ipc_io_backend: str = opt(
        "auto",
        "ipc transport on CUDA: kernel (one Triton kernel on the prefill GPU writes the pages "
        "into the decode pool, also across GPUs over peer access), direct (torch gather, "
        "copy, scatter), auto (kernel on CUDA).",
        ("auto", "kernel", "direct"),
    )
    stream_writes: str = opt(
        "auto",
        "Prefill mode: on: start writing each prefill chunk's KV pages as soon as the chunk "
        "is done, so the transfer runs under the rest of the prefill; off: one write once "
        "the whole prompt is computed; auto: on, but for the mooncake transport on CUDA "
        "without host staging (its io threads' copies of GPU memory wait behind the queued "
        "prefill kernels, measured slower than one write at the end: docs/results.md).",
        ("auto", "on", "off"),
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
    # SGLang's decode-mode spellings of the cache flags above, folded onto them when the
    # config is made (config/cache.py): `kvstrata launch` gives them to decode ranks only.
    disaggregation_decode_enable_radix_cache: bool = opt(
        False, "Decode mode: keep finished requests' KV in a radix cache (L1); the decode "
        "spelling of --no-disable-radix-cache.",
    )  # fmt: skip
    disaggregation_decode_enable_hicache: bool = opt(
        False, "Decode mode: back the decode radix cache with L2 (and L3) tiers; the decode "
        "spelling of --enable-hierarchical-cache.",
    )  # fmt: skip
    disaggregation_decode_hicache_ratio: float = opt(
        2.0, "Decode mode: the decode spelling of --hicache-ratio."
    )
    disaggregation_decode_hicache_size: float = opt(
        0.0, "Decode mode: the decode spelling of --hicache-size."
    )
    disaggregation_decode_prealloc_timeout_s: float = opt(
        300.0,
        "Decode mode: a request that waited this long for KV pages to preallocate (the "
        "pool held by running requests, or by rooms a frozen prefill rank has not released) "
        "fails with 503 instead of waiting on. 0: no limit.",
    )
    disaggregation_decode_hicache_write_policy: str = opt(
        "write_through",
        "Decode mode: the decode spelling of --hicache-write-policy.",
        ("write_through", "write_through_selective", "write_back"),
    )
    disaggregation_decode_local_prefill: str = opt(
        "auto",
        "Decode mode: who prefills a request's uncached prompt tokens. never: a prefill "
        "rank, always; threshold: this rank itself when at most "
        "--disaggregation-decode-local-prefill-max-tokens are uncached; auto: whichever "
        "path has the lower estimated time to first token (local: this rank's measured "
        "step costs plus the delay to its running decodes; remote: the prefill rank's "
        "measured compute and queue plus the transfer at the observed bandwidth).",
        ("never", "threshold", "auto"),
    )
    disaggregation_decode_local_prefill_max_tokens: int = opt(
        2048, "Decode mode, local prefill `threshold`: the most uncached tokens prefilled here."
    )
    disaggregation_decode_local_prefill_chunk_tokens: int = opt(
        1024,
        "Decode mode: prompt tokens a step may compute for local prefills (the running "
        "decodes share the step, so this bounds what a local prefill adds to their TPOT).",
    )
    disaggregation_decode_parallel_restore: bool = opt(
        True,
        "Decode mode with L3: a request whose prefix is still being read from L3 does not "
        "wait for it; its task goes out at once, claiming those pages, and the L3 read runs "
        "beside the prefill and the transfer. A page that does not arrive (gone, corrupt, "
        "past the prefetch timeout) is recomputed here from it to the end (the first token "
        "is kept). Off: the task waits for the read as the prefetch policy says.",
    )
    disaggregation_mooncake_config: str = opt(
        "{}", "JSON options of the mooncake transfer engine (metadata server, protocol, ...)."
    )
    cache_salt: str = opt(
        "", "Extra namespace key for page hashes (e.g. a LoRA id): separates L3 contents."
    )

    def __post_init__(self) -> None:
        fold_decode_aliases(self)
        resolve_key_files(self)
        hide_storage_key(self)
        self.validate()

    def with_l3_key(self, cluster_key: str | None) -> EngineConfig:
        """This config with `cluster_key` as the L3 page secret when it has L3 and no
        secret of its own: the ranks of one cluster share pages, nobody else can make one
        they accept (the MAC key is derived from it, never the bearer token itself)."""
        if cluster_key is None or self.hicache_storage_backend == "none":
            return self
        if self.hicache_storage_key is not None:
            return self
        return dataclasses.replace(self, hicache_storage_key=cluster_key)

    @property
    def l3_key_secret(self) -> str | None:
        """The L3 page secret (from --hicache-storage-key-file or the cluster key), or None."""
        key: object = self.hicache_storage_key
        return key.reveal() if isinstance(key, Secret) else None

    def validate(self) -> None:
        if not self.model:
            raise ConfigError("--model is required")
        if self.model.lower().endswith(".gguf") and os.path.isfile(self.model):
            # A GGUF file is served from its model directory (its metadata as HF files,
            # the GGUF as weights; made once, cached): past this point --model is a dir.
            from kvstrata.model.gguf_dir import resolve_model_dir

            try:
                object.__setattr__(self, "model", str(resolve_model_dir(self.model)))
            except (ValueError, OSError) as e:
                raise ConfigError(f"--model {self.model}: {e}") from e
        if not os.path.isdir(self.model):
            raise ConfigError(f"--model: no such model directory or .gguf file: {self.model}")
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
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.cuda_graph_max_bs < 1:
            raise ConfigError(f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")
        self._validate_disaggregation()
        check_cache(self)
        check_device(self.device, "--device")
        check_choices(self)

    def _validate_disaggregation(self) -> None:
        decode_flags = [
            f.name for f in dataclasses.fields(self)
            if f.name.startswith("disaggregation_decode_") and getattr(self, f.name) != f.default
        ]  # fmt: skip
        if decode_flags and self.disaggregation_mode != "decode":
            raise ConfigError(
                f"{flag(decode_flags[0])} needs --disaggregation-mode decode "
                f"(got {self.disaggregation_mode})"
            )
        if self.disaggregation_decode_prealloc_timeout_s < 0:
            raise ConfigError(
                "--disaggregation-decode-prealloc-timeout-s must be >= 0, got "
                f"{self.disaggregation_decode_prealloc_timeout_s}"
            )
        self._validate_local_prefill()
        if self.disaggregation_transfer_backend == "mooncake":
            try:
                MooncakeTransportConfig.from_json(self.disaggregation_mooncake_config)
            except ValueError as e:
                raise ConfigError(str(e)) from e
        elif self.disaggregation_mooncake_config.strip() not in ("", "{}"):
            raise ConfigError(
                "--disaggregation-mooncake-config needs --disaggregation-transfer-backend mooncake"
            )
        if self.disaggregation_ipc_io_backend == "kernel" and self.device == "cpu":
            raise ConfigError(
                "--disaggregation-ipc-io-backend kernel needs CUDA; use direct on --device cpu"
            )

    def _validate_local_prefill(self) -> None:
        mode = self.disaggregation_decode_local_prefill
        max_tokens = self.disaggregation_decode_local_prefill_max_tokens
        chunk_tokens = self.disaggregation_decode_local_prefill_chunk_tokens
        if max_tokens < 0:
            raise ConfigError(
                f"--disaggregation-decode-local-prefill-max-tokens must be >= 0, got {max_tokens}"
            )
        if chunk_tokens < 1:
            raise ConfigError(
                "--disaggregation-decode-local-prefill-chunk-tokens must be >= 1, got "
                f"{chunk_tokens}"
            )
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        if (
            mode != "threshold"
            and max_tokens != defaults["disaggregation_decode_local_prefill_max_tokens"]
        ):
            raise ConfigError(
                "--disaggregation-decode-local-prefill-max-tokens needs "
                f"--disaggregation-decode-local-prefill threshold (got {mode})"
            )
        if (
            mode == "never"
            and chunk_tokens != defaults["disaggregation_decode_local_prefill_chunk_tokens"]
        ):
            raise ConfigError(
                "--disaggregation-decode-local-prefill-chunk-tokens needs "
                "--disaggregation-decode-local-prefill threshold or auto (got never)"
            )

    @property
    def max_prefill_tokens_per_step(self) -> int:
        """Prompt tokens one step may compute. A decode rank computes prompts only for its
        local prefills, under their own budget so its running decodes keep their pace."""
        if self.disaggregation_mode == "decode":
            chunk_tokens = self.disaggregation_decode_local_prefill_chunk_tokens
            return min(self.max_num_batched_tokens, chunk_tokens)
        return self.max_num_batched_tokens
