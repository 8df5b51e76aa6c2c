"""Frozen configuration dataclasses: the single source of truth for every option.
The CLI is generated from their fields and help text; invalid values and combinations
are refused in each class's `validate`, with a message naming the flag."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


def opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with CLI help text (and optional choices)."""
    return field(default=default, metadata={"help": help, "choices": choices})


def check_device(value: str, option: str) -> None:
    """Raise ConfigError naming `option` unless `value` is auto, cpu, cuda or cuda:N."""
    if value not in ("auto", "cpu", "cuda") and re.fullmatch(r"cuda:\d+", value) is None:
        raise ConfigError(f"{option} must be auto, cpu, cuda or cuda:N, got {value!r}")


class ConfigError(ValueError):
    """An invalid option value or combination; the message names the flag(s)."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine (model, KV pool, scheduler)."""

    model: str = opt("", "Model directory in Hugging Face layout (config.json + safetensors).")
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
    disable_radix_cache: bool = opt(False, "Turn the L1 prefix (radix) cache off.")
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
    seed: int = opt(0, "Seed for sampling requests that do not set their own.")
    # -- hierarchical cache (L2 host memory, L3 storage) --
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
    disaggregation_decode_enable_radix_cache: bool = opt(
        False, "Decode mode: keep finished requests' KV in a radix cache (L1)."
    )
    disaggregation_decode_enable_hicache: bool = opt(
        False, "Decode mode: back the decode radix cache with L2 (and L3) tiers."
    )
    disaggregation_decode_hicache_ratio: float = opt(
        2.0, "Decode mode: L2 pages as a multiple of L1 pages."
    )
    disaggregation_decode_hicache_size: float = opt(
        0.0, "Decode mode: L2 size in GiB (overrides the ratio when > 0)."
    )
    disaggregation_decode_hicache_write_policy: str = opt(
        "write_through",
        "Decode mode: when L1 pages are copied to L2.",
        ("write_through", "write_through_selective", "write_back"),
    )
    disaggregation_mooncake_config: str = opt(
        "{}", "JSON options of the mooncake transfer engine (metadata server, protocol, ...)."
    )
    cache_salt: str = opt(
        "", "Extra namespace key for page hashes (e.g. a LoRA id): separates L3 contents."
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not self.model:
            raise ConfigError("--model is required")
        if not os.path.isdir(self.model):
            raise ConfigError(f"--model: no such model directory: {self.model}")
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
        self._validate_hicache()
        check_device(self.device, "--device")
        _check_choices(self)

    def resolved(self) -> EngineConfig:
        """The engine settings in force: in decode mode the decode cache flags decide the
        radix cache and the hierarchical cache."""
        if self.disaggregation_mode != "decode":
            return self
        return dataclasses.replace(
            self,
            disable_radix_cache=not self.disaggregation_decode_enable_radix_cache,
            enable_hierarchical_cache=self.disaggregation_decode_enable_hicache,
            hicache_ratio=self.disaggregation_decode_hicache_ratio,
            hicache_size=self.disaggregation_decode_hicache_size,
            hicache_write_policy=self.disaggregation_decode_hicache_write_policy,
        )

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
        if self.disaggregation_transfer_backend == "mooncake":
            from kvstrata.disagg.transport.mooncake_config import MooncakeTransportConfig

            try:
                MooncakeTransportConfig.from_json(self.disaggregation_mooncake_config)
            except ValueError as e:
                raise ConfigError(str(e)) from e
        elif self.disaggregation_mooncake_config.strip() not in ("", "{}"):
            raise ConfigError(
                "--disaggregation-mooncake-config needs --disaggregation-transfer-backend mooncake"
            )
        if (
            self.disaggregation_decode_enable_hicache
            and not self.disaggregation_decode_enable_radix_cache
        ):
            raise ConfigError(
                "--disaggregation-decode-enable-hicache needs "
                "--disaggregation-decode-enable-radix-cache"
            )
        if (
            self.disaggregation_mode == "decode"
            and self.enable_hierarchical_cache
            and not self.disaggregation_decode_enable_hicache
        ):
            raise ConfigError(
                "in decode mode use --disaggregation-decode-enable-hicache, not "
                "--enable-hierarchical-cache"
            )

    def _validate_hicache(self) -> None:
        decode = self.disaggregation_mode == "decode"
        hicache_on = self.disaggregation_decode_enable_hicache if decode else (
            self.enable_hierarchical_cache
        )  # fmt: skip
        radix_off = not self.disaggregation_decode_enable_radix_cache if decode else (
            self.disable_radix_cache
        )  # fmt: skip
        for name in ("hicache_ratio", "disaggregation_decode_hicache_ratio"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{flag(name)} must be > 0, got {getattr(self, name)}")
        for name in ("hicache_size", "disaggregation_decode_hicache_size"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.hicache_io_threads < 1:
            raise ConfigError(f"--hicache-io-threads must be >= 1, got {self.hicache_io_threads}")
        if self.hicache_storage_backend != "none" and not hicache_on:
            raise ConfigError(
                "--hicache-storage-backend needs --enable-hierarchical-cache (L3 sits behind L2)"
            )
        if hicache_on and radix_off:
            raise ConfigError(
                "--enable-hierarchical-cache needs the radix cache: drop --disable-radix-cache"
            )
        if self.hicache_io_backend == "kernel" and self.device == "cpu":
            raise ConfigError("--hicache-io-backend kernel needs CUDA; use direct on --device cpu")
        if self.disaggregation_ipc_io_backend == "kernel" and self.device == "cpu":
            raise ConfigError(
                "--disaggregation-ipc-io-backend kernel needs CUDA; use direct on --device cpu"
            )
        if self.hicache_storage_backend == "file" and not self.hicache_storage_dir:
            raise ConfigError("--hicache-storage-backend file needs --hicache-storage-dir")
        try:
            extra = json.loads(self.hicache_storage_backend_extra_config)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--hicache-storage-backend-extra-config is not JSON: {e}") from e
        if not isinstance(extra, dict):
            raise ConfigError("--hicache-storage-backend-extra-config must be a JSON object")


# Per client address, on ranks and the router: generous enough for hundreds of clients
# behind one NAT (and for a router opening connections to a rank under a load spike).
NEW_CONNECTIONS_PER_S = 1000.0
NEW_CONNECTIONS_BURST = 2000


@dataclass(frozen=True)
class ServerConfig:
    """Options of one rank's HTTP front end (`kvstrata serve`)."""

    host: str = opt("127.0.0.1", "Address to listen on.")
    port: int = opt(30000, "TCP port to listen on.")
    api_key: str | None = opt(
        None, "If set, every endpoint but /health needs 'Authorization: Bearer KEY'."
    )
    served_model_name: str | None = opt(
        None, "Model name clients send and responses report; default: the --model value."
    )
    rank: int = opt(0, "This rank's index, reported in usage.kvstrata.rank and /get_load.")
    max_body_bytes: int = opt(32 * 1024 * 1024, "Largest request body accepted (else 413).")
    new_connections_per_s: float = opt(
        NEW_CONNECTIONS_PER_S, "New connections accepted per second from one client address "
        "(a token bucket's refill; 0: no limit). Beyond it: 429.",
    )  # fmt: skip
    new_connections_burst: int = opt(
        NEW_CONNECTIONS_BURST, "New connections one client address may open at once."
    )
    shutdown_grace_s: float = opt(
        30.0, "On SIGTERM: seconds in-flight requests may run before they are aborted."
    )
    log_level: str = opt(
        "info", "Server log level.", ("critical", "error", "warning", "info", "debug")
    )
    prefill_urls: str = opt(
        "",
        "Decode mode: comma-separated prefill rank URLs to use when a request does not "
        "name one (the router names one with the X-Kvstrata-Prefill-Url header).",
    )
    pd_transfer_timeout_s: float = opt(
        600.0, "Decode mode: longest wait for a prefill rank to compute and send a room."
    )

    def __post_init__(self) -> None:
        self.validate()

    @property
    def prefill_url_list(self) -> list[str]:
        return [u.strip().rstrip("/") for u in self.prefill_urls.split(",") if u.strip()]

    def validate(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in [1, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("--api-key must not be empty")
        if self.served_model_name is not None and not self.served_model_name:
            raise ConfigError("--served-model-name must not be empty")
        if self.rank < 0:
            raise ConfigError(f"--rank must be >= 0, got {self.rank}")
        if self.max_body_bytes < 1:
            raise ConfigError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
        _check_connection_limit(self)
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"--shutdown-grace-s must be >= 0, got {self.shutdown_grace_s}")
        if self.pd_transfer_timeout_s <= 0:
            raise ConfigError(
                f"--pd-transfer-timeout-s must be > 0, got {self.pd_transfer_timeout_s}"
            )
        for url in self.prefill_url_list:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"--prefill-urls: {url!r} is not an http(s) URL")
        _check_choices(self)


# Per-token costs measured on one H200 with qwen3-8b shapes (bf16, page 16; docs/results.md,
# issues 4 and 7): the defaults of the `ttft` policy and of `kvstrata simulate`.
H200_KV_BYTES_PER_TOKEN = 147_456  # 2,359,296 bytes per page of all layers / 16 tokens
H200_PREFILL_TOKENS_PER_S = 41_700.0  # W1: 131,072 prompt tokens in 3.14 s of prefill steps
H200_L2_TOKENS_PER_S = 51.0e9 / H200_KV_BYTES_PER_TOKEN  # L2 -> L1 load-back, 51.0 GB/s
H200_L3_TOKENS_PER_S = 1.12e9 / H200_KV_BYTES_PER_TOKEN  # L3 file read, 1.12 GB/s
# No PD transfer was measured: the pinned host-to-device peak (55.5 GB/s) stands in.
H200_TRANSFER_TOKENS_PER_S = 55.5e9 / H200_KV_BYTES_PER_TOKEN


@dataclass(frozen=True)
class RouterConfig:
    """Options of the router (`kvstrata router`): the ranks behind it, how it picks them,
    how it watches their health, and its own HTTP front end."""

    prefill: tuple[str, ...] = opt(
        (),
        "Prefill rank URLs (space- or comma-separated). Leave empty when the --decode ranks "
        "are unified ranks: requests then go to them without a prefill URL.",
    )
    decode: tuple[str, ...] = opt(
        (), "Decode rank URLs (space- or comma-separated); unified ranks if --prefill is empty."
    )
    host: str = opt("127.0.0.1", "Address the router listens on.")
    port: int = opt(30000, "TCP port the router listens on.")
    model: str = opt(
        "", "Model directory; its tokenizer is loaded only if the routing policy needs token ids."
    )
    load_balance_method: str = opt(
        "auto",
        "How a decode rank is picked: round_robin, shortest_queue (fewest running + waiting "
        "requests), total_tokens (fewest queued tokens), cache_aware (longest cached prefix "
        "in the ranks' digests, bounded by load and KV room), ttft (least estimated time to "
        "first token), or auto (cache_aware when several decode ranks keep a prefix cache, "
        "else round_robin). Prefill ranks: shortest_queue.",
        ("auto", "round_robin", "shortest_queue", "total_tokens", "cache_aware", "ttft"),
    )
    dp_routing_digest_chunk_size: int = opt(
        256,
        "Tokens between the prefix hashes of a cache digest (a multiple of the ranks' "
        "page size): the granularity of cache-aware matching.",
    )
    dp_routing_max_extra_reqs: int = opt(
        4,
        "cache_aware: the best-matching rank is skipped for the least-loaded one when it "
        "has more than this many queued requests beyond it.",
    )
    ttft_prefill_tokens_per_s: float = opt(
        H200_PREFILL_TOKENS_PER_S, "ttft: prompt tokens a rank computes per second."
    )
    ttft_transfer_tokens_per_s: float = opt(
        H200_TRANSFER_TOKENS_PER_S, "ttft: prompt tokens of KV moved prefill -> decode per second."
    )
    ttft_l2_tokens_per_s: float = opt(
        H200_L2_TOKENS_PER_S, "ttft: tokens of KV loaded back from L2 (host) per second."
    )
    ttft_l3_tokens_per_s: float = opt(
        H200_L3_TOKENS_PER_S, "ttft: tokens of KV read from L3 (storage) per second."
    )
    ttft_reuse_weight: float = opt(
        4.0,
        "ttft: leaving the rank that holds a request's longest cached prefix is charged this "
        "many prefills of the prefix tokens left behind (the later requests sharing the "
        "prefix that would miss). 0: pure least estimated TTFT.",
    )
    ttft_calibrate: bool = opt(
        True,
        "ttft: scale each rank's estimates by its observed / estimated TTFT (an EWMA over "
        "streamed responses).",
    )
    load_poll_interval_s: float = opt(0.5, "Seconds between polls of every rank's /get_load.")
    load_poll_timeout_s: float = opt(2.0, "A /get_load poll that takes longer has failed.")
    unhealthy_after_failures: int = opt(
        2, "Consecutive failed polls after which a rank gets no more requests until it answers."
    )
    upstream_connect_timeout_s: float = opt(5.0, "Longest wait to connect to a rank.")
    upstream_timeout_s: float = opt(
        600.0, "Longest wait for the next bytes of a rank's response (0: no limit)."
    )
    api_key: str | None = opt(
        None, "If set, clients need 'Authorization: Bearer KEY' everywhere but /health."
    )
    rank_api_key: str | None = opt(None, "The API key the router sends to the ranks.")
    max_body_bytes: int = opt(32 * 1024 * 1024, "Largest request body accepted (else 413).")
    new_connections_per_s: float = opt(
        NEW_CONNECTIONS_PER_S, "New connections accepted per second from one client address "
        "(a token bucket's refill; 0: no limit). Beyond it: 429.",
    )  # fmt: skip
    new_connections_burst: int = opt(
        NEW_CONNECTIONS_BURST, "New connections one client address may open at once."
    )
    log_level: str = opt(
        "info", "Router log level.", ("critical", "error", "warning", "info", "debug")
    )

    def __post_init__(self) -> None:
        # CLI lists arrive as lists and may hold comma-separated items; store clean tuples.
        for name in ("prefill", "decode"):
            object.__setattr__(self, name, _url_list(getattr(self, name)))
        self.validate()

    def validate(self) -> None:
        if not self.decode:
            raise ConfigError("--decode needs at least one rank URL")
        urls = self.prefill + self.decode
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"--prefill/--decode: not an http(s) URL: {url!r}")
        repeated = next((url for url in urls if urls.count(url) > 1), None)
        if repeated is not None:
            raise ConfigError(f"--prefill/--decode: a rank is listed twice: {repeated}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in [1, 65535], got {self.port}")
        if self.model and not os.path.isdir(self.model):
            raise ConfigError(f"--model: no such model directory: {self.model}")
        if self.dp_routing_digest_chunk_size < 1:
            raise ConfigError(
                f"--dp-routing-digest-chunk-size must be >= 1, got "
                f"{self.dp_routing_digest_chunk_size}"
            )
        if self.ttft_reuse_weight < 0:
            raise ConfigError(f"--ttft-reuse-weight must be >= 0, got {self.ttft_reuse_weight}")
        if self.dp_routing_max_extra_reqs < 0:
            raise ConfigError(
                f"--dp-routing-max-extra-reqs must be >= 0, got {self.dp_routing_max_extra_reqs}"
            )
        for name in (
            "load_poll_interval_s", "load_poll_timeout_s", "upstream_connect_timeout_s",
            "ttft_prefill_tokens_per_s", "ttft_transfer_tokens_per_s", "ttft_l2_tokens_per_s",
            "ttft_l3_tokens_per_s",
        ):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ConfigError(f"{flag(name)} must be > 0, got {getattr(self, name)}")
        if self.upstream_timeout_s < 0:
            raise ConfigError(f"--upstream-timeout-s must be >= 0, got {self.upstream_timeout_s}")
        if self.unhealthy_after_failures < 1:
            raise ConfigError(
                f"--unhealthy-after-failures must be >= 1, got {self.unhealthy_after_failures}"
            )
        for name in ("api_key", "rank_api_key"):
            if getattr(self, name) is not None and not getattr(self, name):
                raise ConfigError(f"{flag(name)} must not be empty")
        if self.max_body_bytes < 1:
            raise ConfigError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
        _check_connection_limit(self)
        _check_choices(self)


def _check_connection_limit(config: ServerConfig | RouterConfig) -> None:
    if config.new_connections_per_s < 0:
        raise ConfigError(
            f"--new-connections-per-s must be >= 0, got {config.new_connections_per_s}"
        )
    if config.new_connections_burst < 1:
        raise ConfigError(
            f"--new-connections-burst must be >= 1, got {config.new_connections_burst}"
        )


def _url_list(value: str | typing.Iterable[str]) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else list(value)
    return tuple(
        url.strip().rstrip("/") for item in items for url in item.split(",") if url.strip()
    )


def _check_choices(config: Any) -> None:
    for f in dataclasses.fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        if choices and value not in choices:
            raise ConfigError(f"{flag(f.name)} must be one of {', '.join(choices)}; got {value!r}")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1 and type(None) in typing.get_args(tp):
        return args[0], True
    return tp, False


def add_config_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one CLI flag per field of the config dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        tp, _ = _unwrap_optional(hints[f.name])
        help_text = f.metadata.get("help", "")
        if tp is bool:
            group.add_argument(
                flag(f.name),
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{help_text} (default: {f.default})",
            )
            continue
        # A tuple field (e.g. a list of URLs) takes one or more values: --flag A B.
        is_list = typing.get_origin(tp) is tuple
        group.add_argument(
            flag(f.name),
            dest=f.name,
            type=typing.get_args(tp)[0] if is_list else tp,
            nargs="+" if is_list else None,
            default=None,
            choices=f.metadata.get("choices"),
            help=f"{help_text} (default: {f.default})",
        )


def config_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Build `cls` from parsed flags; flags left unset keep the dataclass default."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if getattr(args, f.name, None) is not None
    }
    values.update(overrides)
    return cls(**values)
