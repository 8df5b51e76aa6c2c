"""What an engine is made of, built once from its config: the model and tokenizer on their
device, the L1 pool with its allocator, cache tiers and request KV manager, and the model
runner. The engine owns them afterwards; nothing here runs a step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvstrata.attention import make_attention_backend
from kvstrata.config import ConfigError, EngineConfig
from kvstrata.engine.kv_manager import RequestKV
from kvstrata.engine.memory import bind_device, num_l1_pages, resolve_device, resolve_dtype
from kvstrata.engine.role import RoleFactory
from kvstrata.engine.runner import ModelRunner, build_runner
from kvstrata.kvcache.factory import make_tiered_cache, namespace_of
from kvstrata.kvcache.pages import KVPool, PageAllocator
from kvstrata.kvcache.tiers import TieredCache
from kvstrata.model.config import ModelConfig
from kvstrata.model.llama import LlamaForCausalLM
from kvstrata.model.loader import load_model
from kvstrata.model.tokenizer import Tokenizer


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
    runner: ModelRunner

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
        decode rank's transport must expose it)."""
        mc = ModelConfig.from_dir(config.model)
        device = resolve_device(config.device)
        bind_device(device)  # for the loads and captures below; each step binds again
        dtype = resolve_dtype(config.dtype, device, mc)
        max_model_len = _max_model_len(config, mc)
        model = load_model(config.model, dtype, device)
        has_tokenizer = (Path(config.model) / "tokenizer.json").is_file()
        tokenizer = Tokenizer(config.model) if has_tokenizer else None
        num_pages = num_l1_pages(config, mc, dtype, device)
        pool_shape = (mc.num_layers, 2, num_pages, config.page_size, mc.num_kv_heads, mc.head_dim)
        pool_data, shm_path = roles.pool_storage(config, pool_shape, dtype, device)
        pool = KVPool(
            num_pages, config.page_size, mc.num_layers, mc.num_kv_heads, mc.head_dim,
            dtype, device, pool_data,
        )  # fmt: skip
        allocator = PageAllocator(num_pages)
        tiers = make_tiered_cache(config, pool, allocator)
        kv = RequestKV(allocator, tiers, config.page_size, namespace_of(config, dtype))
        backend = make_attention_backend(config.attention_backend, pool, device, config.disable_pdl)
        runner = build_runner(config, model, backend, device, max_model_len)
        return cls(
            mc, device, dtype, max_model_len, model, tokenizer, pool, shm_path, allocator,
            tiers, kv, runner,
        )  # fmt: skip


def _max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    model_len = mc.max_context_len
    if config.max_model_len is None:
        return model_len
    if config.max_model_len > model_len:
        raise ConfigError(
            f"--max-model-len {config.max_model_len} exceeds the model's context length {model_len}"
        )
    return config.max_model_len
