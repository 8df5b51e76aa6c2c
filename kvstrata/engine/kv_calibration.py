"""Where an engine's KV scales come from: unit for a non-fp8 pool; for an fp8 pool, a
calibration pass (`--kv-scales-calibrate N` over `--kv-scales-text`) if asked, else the
checkpoint's scales if it has them, else unit. Calibration runs the model once, before the
engine's pool exists, over a scratch pool in the compute dtype."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

from kvstrata.attention.base import AttentionMetadata, BoundAttention
from kvstrata.attention.torch_ref import TorchAttention
from kvstrata.config import ConfigError, EngineConfig
from kvstrata.kvcache.kv_scales import KVScales, is_fp8, scales_from_amax
from kvstrata.kvcache.pages import KVPool
from kvstrata.model.config import ModelConfig
from kvstrata.model.llama import LlamaForCausalLM
from kvstrata.model.loader import KV_SCALE_TENSOR, checkpoint_files
from kvstrata.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvstrata.engine.tp_runner import TPWorkers

CHUNK_TOKENS = 512  # tokens per forward pass: bounds the activations of the pass
SEGMENT_TOKENS = 4096  # the longest sequence calibrated at once (positions 0..4095)


@dataclass(frozen=True)
class Calibrate:
    """What a TP leader tells its followers before WorkerInit: run `calibrate` beside it
    (`tp_follower`); their largest values join the leader's."""

    token_ids: list[int]
    kv_dtype: torch.dtype
    segment_tokens: int


def resolve_kv_scales(
    config: EngineConfig,
    mc: ModelConfig,
    model: LlamaForCausalLM,
    tokenizer: Tokenizer | None,
    kv_dtype: torch.dtype,
    max_model_len: int,
    workers: TPWorkers | None = None,
) -> KVScales:
    """The scales the engine's pool is built with (see the module docstring). A TP rank's
    `workers` calibrate beside the leader, each on its own heads."""
    if not is_fp8(kv_dtype):
        return KVScales.unit(mc.num_layers)
    num_tokens = config.model.kv_scales_calibrate
    if num_tokens:
        token_ids = _calibration_tokens(config.model.kv_scales_text, num_tokens, tokenizer)
        segment_tokens = min(max_model_len, SEGMENT_TOKENS)
        if workers is not None:
            workers.send(Calibrate(token_ids, kv_dtype, segment_tokens))
        return calibrate(model, token_ids, kv_dtype, segment_tokens)
    try:
        found = checkpoint_scales(checkpoint_files(Path(config.model.path)), mc.num_layers)
    except ValueError as e:
        raise ConfigError(f"--kv-cache-dtype {config.model.kv_cache_dtype}: {e}") from e
    return found if found is not None else KVScales.unit(mc.num_layers)


def checkpoint_scales(files: list[Path], num_layers: int) -> KVScales | None:
    """The KV scales a safetensors checkpoint carries (`model.layers.N.self_attn.k_scale`
    and `v_scale`, one number each), or None if it carries none. A checkpoint with some
    but not all of them is refused (ValueError naming what is missing)."""
    found: dict[tuple[str, int], float] = {}
    for path in files:
        if path.suffix != ".safetensors":
            continue
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names = list(f.keys())
                for name in names:
                    match = KV_SCALE_TENSOR.match(name)
                    if match is None:
                        continue
                    tensor = f.get_tensor(name).float()
                    if tensor.numel() != 1:
                        raise ValueError(
                            f"{name} in {path} has {tensor.numel()} values; kvstrata reads "
                            "one KV scale per layer"
                        )
                    found[(match[2], int(match[1]))] = float(tensor.item())
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read checkpoint file {path}: {e}") from e
    if not found:
        return None
    wanted = [(kind, layer) for kind in "kv" for layer in range(num_layers)]
    missing = [
        f"model.layers.{layer}.self_attn.{kind}_scale"
        for kind, layer in wanted
        if (kind, layer) not in found
    ]
    if missing:
        raise ValueError(f"the checkpoint's KV scales are incomplete: no {', '.join(missing[:4])}")
    k = tuple(found[("k", layer)] for layer in range(num_layers))
    v = tuple(found[("v", layer)] for layer in range(num_layers))
    return KVScales(k, v, "checkpoint")


def _calibration_tokens(path: str, num_tokens: int, tokenizer: Tokenizer | None) -> list[int]:
    if tokenizer is None:
        raise ConfigError("--kv-scales-calibrate needs the model's tokenizer (tokenizer.json)")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--kv-scales-text {path}: {e}") from e
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    if len(token_ids) < num_tokens:
        raise ConfigError(
            f"--kv-scales-text {path} has {len(token_ids)} tokens; --kv-scales-calibrate "
            f"asks for {num_tokens}"
        )
    return token_ids[:num_tokens]


class _AmaxRecorder:
    """The torch attention backend over a scratch pool, noting each layer's largest |K|
    and |V| (as device tensors: one sync at the end, not one per layer)."""

    def __init__(self, pool: KVPool) -> None:
        self.inner = TorchAttention(pool)
        zeros = torch.zeros(pool.num_layers, dtype=torch.float32, device=pool.data.device)
        self.k_amax, self.v_amax = zeros, zeros.clone()

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        scale: float,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert k is not None and v is not None
        self.k_amax[layer_id] = torch.maximum(self.k_amax[layer_id], k.abs().max().float())
        self.v_amax[layer_id] = torch.maximum(self.v_amax[layer_id], v.abs().max().float())
        return self.inner.forward(layer_id, q, k, v, scale, meta)


@torch.inference_mode()
def calibrate(
    model: LlamaForCausalLM, token_ids: list[int], kv_dtype: torch.dtype, segment_tokens: int
) -> KVScales:
    """Scales from the K and V the model computes (after its norms and RoPE, in its own
    dtype) over `token_ids`, read as sequences of at most `segment_tokens`. A TP worker's
    model holds some heads: the largest values are taken over the group."""
    mc = model.config  # this worker's heads
    weight = model.model.embed_tokens.weight
    device, dtype = weight.device, weight.dtype
    page_size = 16
    num_pages = -(-segment_tokens // page_size)
    pool = KVPool(num_pages, page_size, mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype, device)
    recorder = _AmaxRecorder(pool)
    pages = list(range(num_pages))
    try:
        for start in range(0, len(token_ids), segment_tokens):
            segment = token_ids[start : start + segment_tokens]
            for begin in range(0, len(segment), CHUNK_TOKENS):
                end = min(begin + CHUNK_TOKENS, len(segment))
                meta = AttentionMetadata(
                    query_lens=[end - begin],
                    kv_lens=[end],
                    page_tables=[pages[: -(-end // page_size)]],
                    slot_mapping=torch.arange(begin, end, device=device),
                )
                ids = torch.tensor(segment[begin:end], dtype=torch.long, device=device)
                positions = torch.arange(begin, end, device=device)
                model(ids, positions, BoundAttention(recorder, meta))
        amax = model.tp.all_reduce_max(torch.stack([recorder.k_amax, recorder.v_amax]))
        k_amax, v_amax = amax[0].tolist(), amax[1].tolist()
    finally:
        pool.release()
    return scales_from_amax(k_amax, v_amax, kv_dtype, "calibrated")
