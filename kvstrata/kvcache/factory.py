"""Builds the engine's caches from its settings: the one place that chooses between
`RadixCache` and `NoPrefixCache`, and between L1 only and the L1/L2/L3 HiRadixCache."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Protocol

import torch

from kvstrata.config import ConfigError, EngineConfig
from kvstrata.config.cache import L2Options, L3Options
from kvstrata.kvcache.base import PrefixCache
from kvstrata.kvcache.copier import Copier, TorchCopier
from kvstrata.kvcache.hicache_policy import PrefetchPolicy, WritePolicy
from kvstrata.kvcache.hiradix import HiRadixCache
from kvstrata.kvcache.host import HostCache
from kvstrata.kvcache.host_pool import HostPool
from kvstrata.kvcache.kv_scales import KVScales
from kvstrata.kvcache.l3_io import L3IO, L3Port, slice_salt
from kvstrata.kvcache.nocache import NoPrefixCache
from kvstrata.kvcache.pages import KVPool, PageAllocator
from kvstrata.kvcache.radix import RadixCache, check_eviction_policy
from kvstrata.kvcache.tiers import L1Tiers, TieredCache

if TYPE_CHECKING:
    from kvstrata.kvcache.storage.trust import L3Trust


def make_prefix_cache(
    allocator: PageAllocator, page_size: int, enabled: bool, eviction_policy: str = "lru"
) -> PrefixCache:
    """A `RadixCache` with `eviction_policy` ("lru" | "lfu" | "priority"), or a
    `NoPrefixCache` when the radix cache is disabled (the policy is still validated, so a
    typo never hides behind a disabled cache)."""
    check_eviction_policy(eviction_policy)
    if not enabled:
        return NoPrefixCache(allocator, page_size)
    return RadixCache(allocator, page_size, eviction_policy)


def host_pool_pages(config: L2Options, num_l1_pages: int, page_bytes: int) -> int:
    """L2 pages from --hicache-size (GiB) or --hicache-ratio; refuses a pool that does
    not fit in the host's available memory."""
    if config.size_gb > 0:
        num_pages = int(config.size_gb * (1 << 30)) // page_bytes
        flag = "--hicache-size"
    else:
        num_pages = int(num_l1_pages * config.ratio)
        flag = "--hicache-ratio"
    if num_pages < 1:
        raise ConfigError(f"{flag} gives an L2 pool of no pages")
    available_bytes = _available_host_bytes()
    if available_bytes is not None and num_pages * page_bytes > available_bytes:
        raise ConfigError(
            f"{flag} asks for an L2 pool of {num_pages * page_bytes / (1 << 30):.2f} GiB but "
            f"only {available_bytes / (1 << 30):.2f} GiB of host memory is available"
        )
    return num_pages


def _available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def make_l3(config: EngineConfig, host_pool: HostPool, namespace: bytes, tp_rank: int) -> L3IO:
    """L3 (--hicache-storage-backend) over `host_pool`; a tensor-parallel worker's keys
    are its slice's (`slice_salt`)."""
    from kvstrata.kvcache.storage import make_storage_backend

    l3_options = config.l3
    options = json.loads(l3_options.extra_config)
    if l3_options.backend == "file":
        options.setdefault("directory", l3_options.dir)
    backend = make_storage_backend(
        l3_options.backend, host_pool.page_bytes, namespace, options, storage_trust(l3_options)
    )
    salt = slice_salt(config.model.tp_size, tp_rank)
    return L3IO(backend, host_pool, l3_options.io_threads, salt)


class TierWrap(Protocol):
    """Wrappers of a cache's copier and L3 (see `make_tiered_cache`)."""

    def copier(self, inner: Copier) -> Copier: ...

    def l3(self, inner: L3IO) -> L3Port: ...


def make_tiered_cache(
    config: EngineConfig,
    l1_pool: KVPool,
    allocator: PageAllocator,
    wrap: TierWrap | None = None,
) -> TieredCache:
    """`L1Tiers` over the configured prefix cache, or, with --enable-hierarchical-cache,
    a `HiRadixCache` with its L2 host pool and optional L3 backend. `wrap`: what the
    L1 <-> L2 copier and L3 are wrapped in (a TP rank's leader: ones its followers mirror;
    its own L3 keys are then those of its slice)."""
    page_size, l2, l3_options = config.pool.page_size, config.l2, config.l3
    l1 = make_prefix_cache(
        allocator, page_size, not config.l1.disable_radix_cache, config.l1.eviction_policy
    )
    if not l2.enabled:
        return L1Tiers(l1)
    assert isinstance(l1, RadixCache)  # validated: hierarchical cache needs the radix cache
    k = l1_pool.k_cache[0]
    host_pool = HostPool(
        host_pool_pages(l2, allocator.num_total_pages, l1_pool.page_bytes),
        page_size,
        l1_pool.num_layers,
        k.shape[2],
        k.shape[3],
        k.dtype,
        pin_memory=k.is_cuda,
    )
    l3: L3Port | None = None
    if l3_options.backend != "none":
        namespace = namespace_of(config, k.dtype, l1_pool.scales)
        l3_io = make_l3(config, host_pool, namespace, tp_rank=0)
        l3 = wrap.l3(l3_io) if wrap is not None else l3_io
    prefetch = PrefetchPolicy(
        l3_options.prefetch_policy,
        l3_options.prefetch_timeout_base_s,
        l3_options.prefetch_timeout_per_1k_tokens_s,
        l3_options.prefetch_threshold,
    )
    copier = make_copier(l2.io_backend, l1_pool, host_pool)
    return HiRadixCache(
        l1,
        HostCache(PageAllocator(host_pool.num_pages)),
        wrap.copier(copier) if wrap is not None else copier,
        WritePolicy.named(l2.write_policy),
        l3,
        prefetch,
        inclusive=l2.inclusion == "inclusive",
    )


def storage_trust(config: L3Options) -> L3Trust:
    """Whose L3 pages this engine accepts: those MACed with the key of its secret (given,
    or a served rank's cluster key), else the backend's own key; the file modes."""
    from kvstrata.kvcache.storage.trust import L3Trust, mac_key_from_secret

    secret = config.key_secret
    return L3Trust(
        mac_key=None if secret is None else mac_key_from_secret(secret),
        file_mode=config.file_mode,
        allow_shared_dir=config.allow_shared_dir,
    )


def make_copier(io_backend: str, l1_pool: KVPool, host_pool: HostPool) -> Copier:
    """The Triton zero-copy kernel on CUDA (`auto` or `kernel`), torch indexing elsewhere."""
    on_cuda = l1_pool.data.is_cuda
    if io_backend == "kernel" and not on_cuda:
        raise ConfigError("--hicache-io-backend kernel needs the L1 pool on CUDA")
    if io_backend == "direct" or not on_cuda:
        return TorchCopier(l1_pool, host_pool)
    from kvstrata.kvcache.copier_triton import TritonCopier

    return TritonCopier(l1_pool, host_pool)


def namespace_of(
    config: EngineConfig, kv_dtype: torch.dtype, scales: KVScales | None = None
) -> bytes:
    """The page-hash namespace seed: model (its weights' contents), page size, KV dtype
    with its scales' fingerprint (none for unit scales) and cache salt."""
    from kvstrata.kvcache.hashing import namespace_seed
    from kvstrata.model.identity import model_identity

    return namespace_seed(
        model_identity(config.model.path),
        config.pool.page_size,
        str(kv_dtype) + (f":{scales.fingerprint}" if scales and scales.fingerprint else ""),
        config.model.cache_salt,
    )
