"""`EngineConfig`: the options of one engine in sections (model, pool, scheduler, cache
L1/L2/L3, PD, speed; a parallelism section goes beside them), made from flags by
`from_flags` (engine_flags.py resolves them first) and checked across sections here, each
refusal naming its flag."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from kvstrata.config import engine_flags
from kvstrata.config.cache import L1Options, L2Options, L3Options
from kvstrata.config.options import ConfigError, flag
from kvstrata.config.pd import PDOptions
from kvstrata.config.secret import Secret
from kvstrata.config.sections import ModelOptions, PoolOptions, SchedulerOptions, SpeedOptions
from kvstrata.config.sessions import SessionOptions


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine, one section per part; the settings in force (aliases and
    role defaults were resolved before it was made, see `from_flags`)."""

    model: ModelOptions
    pool: PoolOptions = field(default_factory=PoolOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    l1: L1Options = field(default_factory=L1Options)
    l2: L2Options = field(default_factory=L2Options)
    l3: L3Options = field(default_factory=L3Options)
    sessions: SessionOptions = field(default_factory=SessionOptions)
    pd: PDOptions = field(default_factory=PDOptions)
    speed: SpeedOptions = field(default_factory=SpeedOptions)

    @classmethod
    def from_flags(cls, **flags: Any) -> EngineConfig:
        """The config the flags `flags` (by name: `page_size=16`, decode spellings and
        `_file` companions included) ask for. Raises ConfigError naming the flag."""
        values = engine_flags.resolve_flags(flags)
        values = engine_flags.read_secrets(values, flags)
        if "model" not in values:
            raise ConfigError("--model is required")
        return cls(**engine_flags.sections_from(values))

    @staticmethod
    def flag_names() -> frozenset[str]:
        return engine_flags.flag_names()

    @staticmethod
    def secret_flags() -> list[str]:
        return [name for name, f in engine_flags.main_flags().items() if f.secret]

    @staticmethod
    def add_flags(parser: Any) -> None:
        engine_flags.add_engine_args(parser)

    def flags(self) -> dict[str, Any]:
        """Every flag's setting in force, by flag name (aliases included): /server_info."""
        return engine_flags.flags_in_force(
            {s.attr: getattr(self, s.attr) for s in engine_flags.SECTIONS}
        )

    def __post_init__(self) -> None:
        path = self.model.path
        if not (os.path.isdir(path) or (path.lower().endswith(".gguf") and os.path.isfile(path))):
            raise ConfigError(f"--model: no such model directory or .gguf file: {path}")
        self._check_cache()
        device = self.model.device
        if self.pd.ipc_io_backend == "kernel" and device == "cpu":
            raise ConfigError(
                "--disaggregation-ipc-io-backend kernel needs CUDA; use direct on --device cpu"
            )
        if self.l2.io_backend == "kernel" and device == "cpu":
            raise ConfigError("--hicache-io-backend kernel needs CUDA; use direct on --device cpu")

    def _check_cache(self) -> None:
        """What needs two sections: L3 sits behind L2, L2 behind the radix cache. On a
        decode rank a message names the decode spelling of an L2 flag too."""
        if self.l2.ratio <= 0:
            raise ConfigError(f"{self._l2_flag('hicache_ratio')} must be > 0, got {self.l2.ratio}")
        if self.l2.size_gb < 0:
            raise ConfigError(
                f"{self._l2_flag('hicache_size')} must be >= 0, got {self.l2.size_gb}"
            )
        hicache = self._l2_flag("enable_hierarchical_cache")
        if self.l3.backend != "none" and not self.l2.enabled:
            raise ConfigError(f"--hicache-storage-backend needs {hicache} (L3 sits behind L2)")
        if self.l2.enabled and self.l1.disable_radix_cache:
            if self.pd.is_decode:
                raise ConfigError(
                    f"{hicache} needs the radix cache, which decode ranks keep only when "
                    f"asked: give {flag(engine_flags.RADIX_ALIAS)}"
                )
            raise ConfigError(f"{hicache} needs the radix cache: drop --disable-radix-cache")

    def _l2_flag(self, name: str) -> str:
        """The flag `name`, with its decode spelling on a decode rank."""
        if not self.pd.is_decode:
            return flag(name)
        alias = next(a for a, m in engine_flags.DECODE_ALIASES.items() if m == name)
        return f"{flag(name)} ({flag(alias)})"

    def with_l3_key(self, cluster_key: str | None) -> EngineConfig:
        """This config with `cluster_key` as the L3 page secret when it has L3 and no
        secret of its own: the ranks of one cluster share pages, nobody else can make one
        they accept (the MAC key is derived from it, never the bearer token itself)."""
        if cluster_key is None or self.l3.backend == "none" or self.l3.key is not None:
            return self
        return dataclasses.replace(self, l3=dataclasses.replace(self.l3, key=Secret(cluster_key)))

    def with_model_dir(self, model_dir: str) -> EngineConfig:
        """This config with --model as the directory it resolved to (a GGUF file's)."""
        return dataclasses.replace(self, model=dataclasses.replace(self.model, path=model_dir))

    @property
    def l3_key_secret(self) -> str | None:
        """The L3 page secret (from --hicache-storage-key-file or the cluster key), or None."""
        return self.l3.key_secret

    @property
    def max_prefill_tokens_per_step(self) -> int:
        """Prompt tokens one step may compute. A decode rank computes prompts only for its
        local prefills, under their own budget so its running decodes keep their pace."""
        budget = self.scheduler.max_num_batched_tokens
        if self.pd.is_decode:
            return min(budget, self.pd.local_prefill_chunk_tokens)
        return budget
