"""Loads a Llama-family checkpoint (config.json + safetensors, single file or sharded, or a
GGUF file's model directory, see gguf_dir.py) into a LlamaForCausalLM on a given device
and dtype, checking every tensor."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvstrata.model.config import ModelConfig
from kvstrata.model.gguf import GgufCheckpoint
from kvstrata.model.gguf_dir import gguf_weights, resolve_model_dir
from kvstrata.model.llama import LlamaForCausalLM
from kvstrata.model.model_dir import read_json
from kvstrata.model.tp_shard import Shard

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A layer's fp8 KV scales as vLLM and llm-compressor name them (kvcache/kv_scales.py reads
# them); not weights.
KV_SCALE_TENSOR = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k|v)_scale$")
INDEX_FILE = "model.safetensors.index.json"


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    shard: Shard | None = None,
) -> LlamaForCausalLM:
    """Build the model described by `model_dir/config.json` (or a .gguf file) and fill it
    from the checkpoint; with `shard`, only that tensor-parallel worker's part (each
    tensor read on the CPU, cut, then moved: no device ever holds the whole model).
    Raises FileNotFoundError for a missing directory or file, ValueError (naming the
    tensor or field) for a checkpoint that does not match its config, and ShardError for
    a split that does not divide."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; supported: {SUPPORTED_DTYPES}")
    model_dir = resolve_model_dir(model_dir)
    config = ModelConfig.from_dir(model_dir)
    gguf_path = gguf_weights(model_dir)
    gguf = GgufCheckpoint(gguf_path) if gguf_path is not None else None
    tensor_files: dict[str, Path]
    if gguf is not None and gguf_path is not None:
        tensor_files = dict.fromkeys(gguf.tensor_names(), gguf_path)
    else:
        tensor_files = _index_tensors(checkpoint_files(model_dir))
    if not config.tie_word_embeddings and "lm_head.weight" not in tensor_files:
        # No separate head stored: the checkpoint means the embedding to be reused.
        config = replace(config, tie_word_embeddings=True)
    # Build on `meta` so no memory is spent on a random init that the checkpoint would
    # overwrite; `assign=True` below puts the loaded tensors in place of the meta ones.
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    _check_names(model_dir, tensor_files, expected, config)
    keep: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    if shard is not None:
        shard.check(config)
        full_config = config

        def keep(name: str, tensor: torch.Tensor) -> torch.Tensor:
            # Cut as each tensor is read: a worker never holds the whole model at once.
            return shard.cut(name, tensor, full_config).to(device)

        with torch.device("meta"):
            model = LlamaForCausalLM(shard.local_config(config))
    read_on = torch.device("cpu") if shard is not None else torch.device(device)
    if gguf is not None:
        state = _read_gguf(gguf, expected, dtype, read_on, keep)
    else:
        state = _read_tensors(tensor_files, expected, dtype, read_on, keep)
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)  # moves the RoPE buffers, which were built on the CPU
    model.eval().requires_grad_(False)
    return model


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The weight files of a checkpoint: those the shard index names when there is one (a
    repo may hold other formats' files beside them), else every `*.safetensors`, else
    its one GGUF file."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path} has no 'weight_map'")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        gguf_path = None if files else gguf_weights(model_dir)
        files = files or ([gguf_path] if gguf_path is not None else [])
        if not files:
            raise FileNotFoundError(f"no *.safetensors or *.gguf file in {model_dir}")
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint shard {path} not found")
    return files


def _index_tensors(files: list[Path]) -> dict[str, Path]:
    """Tensor name -> the file holding it (headers only; no tensor data is read)."""
    tensor_files: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names = list(f.keys())
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read checkpoint file {path}: {e}") from e
        for name in names:
            if name in tensor_files:
                raise ValueError(f"tensor {name!r} is in both {tensor_files[name]} and {path}")
            tensor_files[name] = path
    return tensor_files


def _check_names(
    model_dir: Path,
    tensor_files: dict[str, Path],
    expected: dict[str, tuple[int, ...]],
    config: ModelConfig,
) -> None:
    """Every expected tensor is stored, and nothing stored goes unused (an unused tensor
    means the config describes a different model than the weights, e.g. a missing bias
    flag)."""
    missing = [name for name in expected if name not in tensor_files]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(
            f"checkpoint in {model_dir} is missing weight(s): {', '.join(missing[:5])}{more}"
        )
    unexpected = [n for n in tensor_files if n not in expected and not _is_ignored(n, config)]
    if unexpected:
        raise ValueError(
            f"checkpoint in {model_dir} has tensor(s) that {config.architecture} with this "
            f"config.json does not use: {', '.join(unexpected[:5])}"
        )


def _read_tensors(
    tensor_files: dict[str, Path],
    expected: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device,
    keep: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Read the tensors `expected` names (name -> shape), cast to dtype, on device; each
    through `keep` (a TP worker's cut) if given."""
    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(tensor_files[name], []).append(name)
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in names:
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != expected[name]:
                        raise ValueError(
                            f"tensor {name!r} in {path} has shape {tuple(tensor.shape)}, "
                            f"expected {expected[name]}"
                        )
                    tensor = tensor.to(device=device, dtype=dtype)
                    state[name] = keep(name, tensor) if keep is not None else tensor
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read checkpoint file {path}: {e}") from e
    return state


def _read_gguf(
    gguf: GgufCheckpoint,
    expected: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device,
    keep: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """`_read_tensors` for a GGUF file: each tensor dequantized straight into dtype."""
    state: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        tensor = gguf.read(name, dtype, device)
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"tensor {name!r} in {gguf.path} has shape {tuple(tensor.shape)}, expected {shape}"
            )
        state[name] = keep(name, tensor) if keep is not None else tensor
    return state


def _is_ignored(name: str, config: ModelConfig) -> bool:
    # Old exports carry the RoPE frequency buffer (we recompute it); fp8 exports carry KV
    # scales (not weights); tied models may
    # still store a copy of the embedding as lm_head (we read the embedding).
    if name.endswith("rotary_emb.inv_freq") or KV_SCALE_TENSOR.match(name):
        return True  # KV scales: read by kv_scales.checkpoint_scales when KV is fp8
    return config.tie_word_embeddings and name == "lm_head.weight"
