"""What an engine is made of, built once from its config: the model and tokenizer on their
device, the L1 pool with its allocator, cache tiers and request KV manager, and the model
runner. The engine owns them afterwards; nothing here runs a step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvstrata.attention import make_attention_backend
from kvstrata.config import ConfigError, EngineConfig
from kvstrata.config.sections import SchedulerOptions
from kvstrata.engine.kv_calibration import resolve_kv_scales
from kvstrata.engine.kv_manager import RequestKV
from kvstrata.engine.memory import (
    bind_device,
    num_l1_pages,
    resolve_device,
    resolve_dtype,
    resolve_kv_dtype,
)
from kvstrata.engine.role import RoleFactory
from kvstrata.engine.runner import ModelRunner, build_runner
from kvstrata.engine.tp_follower import WorkerInit
from kvstrata.engine.tp_runner import TPRunner, TPWorkers, TPWrap
from kvstrata.engine.tp_transfer import TPTransfers, follower_endpoints
from kvstrata.kvcache.factory import host_pool_pages, make_tiered_cache, namespace_of
from kvstrata.kvcache.pages import KVPool, PageAllocator
from kvstrata.kvcache.sessions import SessionTable
from kvstrata.kvcache.tiers import TieredCache
from kvstrata.model.config import ModelConfig
from kvstrata.model.gguf_dir import resolve_model_dir
from kvstrata.model.llama import LlamaForCausalLM
from kvstrata.model.loader import load_model
from kvstrata.model.tokenizer import Tokenizer
from kvstrata.model.tp_shard import Shard, ShardError


@dataclass(frozen=True)
class EngineParts:
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None  # None: the model directory has no tokenizer.json
    pool: KVPool
    shm_path: Path | None  # the pool's shared-memory file (an `ipc` decode rank on CPU)
    allocator: PageAllocator
    tiers: TieredCache
    kv: RequestKV
    sessions: SessionTable
    runner: ModelRunner | TPRunner
    tp: TPTransfers | None  # a TP rank's followers' transfer ends (None at TP 1)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's and the tokenizer's end-of-sequence ids, each once, in that order."""
        ids = tuple(self.model_config.eos_token_ids)
        ids += self.tokenizer.eos_token_ids if self.tokenizer else ()
        return tuple(dict.fromkeys(ids))

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @classmethod
    def build(cls, config: EngineConfig, roles: RoleFactory) -> EngineParts:
        """`config` resolved; `roles` says where the L1 pool lives (shared memory when a
        decode rank's transport must expose it). With --tp-size N this process is worker 0
        of N: the followers start first and load their shards beside it."""
        device = resolve_device(config.model.device)
        bind_device(device)  # for the loads and captures below; each step binds again
        if config.model.tp_size == 1:
            return cls._build(config, roles, device, None)
        workers = TPWorkers(config, device, roles)
        try:
            return cls._build(config, roles, device, workers)
        except BaseException:
            workers.close()
            raise

    @classmethod
    def _build(
        cls,
        config: EngineConfig,
        roles: RoleFactory,
        device: torch.device,
        workers: TPWorkers | None,
    ) -> EngineParts:
        model_dir, page_size = config.model.path, config.pool.page_size
        mc = ModelConfig.from_dir(model_dir)
        dtype = resolve_dtype(config.model.dtype, device, mc)
        max_model_len = _max_model_len(config.scheduler, mc)
        shard = Shard(0, workers.group.size) if workers is not None else None
        try:
            model = load_model(model_dir, dtype, device, shard)
        except ShardError as e:
            raise ConfigError(str(e)) from e
        local = mc if shard is None else shard.local_config(mc)  # this worker's heads
        if workers is not None:
            model.set_tp(workers.group, 0, mc.vocab_size)
        has_tokenizer = (Path(model_dir) / "tokenizer.json").is_file()
        tokenizer = Tokenizer(model_dir) if has_tokenizer else None
        kv_dtype = resolve_kv_dtype(config.model.kv_cache_dtype, dtype, device)
        scales = resolve_kv_scales(config, mc, model, tokenizer, kv_dtype, max_model_len, workers)
        num_pages = num_l1_pages(config, local, kv_dtype, device)
        pool_shape = (mc.num_layers, 2, num_pages, page_size, local.num_kv_heads, mc.head_dim)
        pool_data, shm_path = roles.pool_storage(config, pool_shape, kv_dtype, device)
        pool = KVPool(
            num_pages,
            page_size,
            mc.num_layers,
            local.num_kv_heads,
            mc.head_dim,
            kv_dtype,
            device,
            pool_data,
            scales,
        )
        allocator = PageAllocator(num_pages)
        wrap = TPWrap(workers) if workers is not None else None
        tiers = make_tiered_cache(config, pool, allocator, wrap)
        sessions = SessionTable(tiers, config.sessions)
        kv = RequestKV(
            allocator, tiers, page_size, namespace_of(config, kv_dtype, scales), sessions
        )
        speed = config.speed
        backend = make_attention_backend(speed.attention_backend, pool, device, speed.disable_pdl)
        if workers is not None:
            host_pages = host_pool_pages(config.l2, num_pages, pool.page_bytes)
            l3_namespace = (
                namespace_of(config, kv_dtype, scales) if config.l3.backend != "none" else None
            )
            init = WorkerInit(num_pages, kv_dtype, scales, max_model_len, host_pages, l3_namespace)
            workers.start_serving(init)
        local_runner = build_runner(config, model, backend, device, max_model_len)
        runner: ModelRunner | TPRunner = local_runner
        transfers = None
        if workers is not None:
            workers.ready()  # every worker built its runner (graph captures run together)
            runner = TPRunner(local_runner, workers)
            transfers = TPTransfers(workers, follower_endpoints(workers.group))
        return cls(
            mc,
            device,
            dtype,
            max_model_len,
            model,
            tokenizer,
            pool,
            shm_path,
            allocator,
            tiers,
            kv,
            sessions,
            runner,
            transfers,
        )


def resolve_model_source(config: EngineConfig) -> EngineConfig:
    """`config` with --model as a model directory: a GGUF file's is laid out here, once,
    at start-up (cached across runs), and every consumer reads that directory."""
    try:
        model_dir = str(resolve_model_dir(config.model.path))
    except (ValueError, OSError) as e:
        raise ConfigError(f"--model {config.model.path}: {e}") from e
    return config if model_dir == config.model.path else config.with_model_dir(model_dir)


def _max_model_len(config: SchedulerOptions, mc: ModelConfig) -> int:
    model_len = mc.max_context_len
    if config.max_model_len is None:
        return model_len
    if config.max_model_len > model_len:
        raise ConfigError(
            f"--max-model-len {config.max_model_len} exceeds the model's context length {model_len}"
        )
    return config.max_model_len
