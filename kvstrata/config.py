"""Frozen configuration dataclasses: the single source of truth for every option.
The CLI is generated from their fields and help text; invalid values and combinations
are refused in each class's `validate`, with a message naming the flag."""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


def opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with CLI help text (and optional choices)."""
    return field(default=default, metadata={"help": help, "choices": choices})


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
    seed: int = opt(0, "Seed for sampling requests that do not set their own.")

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
        if self.device != "auto" and not (
            self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")
        ):
            raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        _check_choices(self)


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
        group.add_argument(
            flag(f.name),
            dest=f.name,
            type=tp,
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
