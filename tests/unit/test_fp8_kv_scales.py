"""FP8 KV scales (issue 31): `--kv-scales-calibrate N` measures each layer's K and V scale
on N tokens of a text, a checkpoint's k_scale/v_scale tensors are read when present, and
the scales are part of the KV identity: PD with calibrated scales (ipc and mooncake)
equals the unified engine token for token, a pair whose scales differ is refused naming
both, and L3 pages written under one set of scales are never read under another."""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvstrata import LLM
from kvstrata.config import ConfigError, EngineConfig
from kvstrata.disagg.wire import TaskRefused, parse_task
from kvstrata.kvcache.kv_scales import fp8_max
from kvstrata.model.config import ModelConfig
from kvstrata.pd.prefill_endpoints import _task_limits

sys.path.insert(0, str(Path(__file__).parent))
from mooncake_fixtures import require_mooncake
from test_fp8_kv import L3_FLAGS
from test_pd_engine import GREEDY, PAGE, serve_pd

P2P = json.dumps({"metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "timeout_s": 2.0})
CALIBRATE_TOKENS = 200


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    words = ["the", "cache", "holds", "every", "page", "of", "a", "long", "conversation"]
    rng = random.Random(5)
    path = tmp_path_factory.mktemp("calibration") / "text.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(2000)), encoding="utf-8")
    return path


def calibrated(text: Path) -> dict[str, object]:
    return {
        "kv_cache_dtype": "fp8",
        "kv_scales_calibrate": CALIBRATE_TOKENS,
        "kv_scales_text": str(text),
    }


def test_calibration_maps_each_layers_largest_value_onto_the_fp8_range(
    tiny_llama: Path, text: Path
) -> None:
    flags = {"page_size": PAGE, "num_kv_pages": 128}
    with LLM(str(tiny_llama), **flags, **calibrated(text)) as llm:
        scales = llm.engine.pool.scales
        prompt = llm.engine.tokenizer.encode(text.read_text(), add_special_tokens=False)
        llm.generate(input_ids=[prompt[:CALIBRATE_TOKENS]], sampling_params=GREEDY)
        stored = [llm.engine.pool.k_cache[layer].float().abs().max() for layer in range(2)]
    with LLM(str(tiny_llama), **flags, **calibrated(text)) as again:
        assert again.engine.pool.scales == scales  # deterministic: one text, one identity
    assert scales.source == "calibrated" and not scales.is_unit
    assert all(0 < s < 1 for s in (*scales.k, *scales.v))  # the tiny model's K, V are small
    assert all(math.log2(s).is_integer() for s in (*scales.k, *scales.v))  # powers of two
    # The calibration prompt's largest K lands in the top binade of the fp8 range.
    top = fp8_max(torch.float8_e4m3fn)
    assert all(top / 2 < float(value) <= top for value in stored)
    assert len(scales.fingerprint) == 16


@pytest.mark.parametrize("transport", ["ipc", "mooncake"])
def test_pd_with_calibrated_scales_equals_the_unified_engine(
    tiny_llama: Path, text: Path, tmp_path: Path, transport: str
) -> None:
    if transport == "mooncake":
        require_mooncake()
    backend = (
        {"disaggregation_transfer_backend": "mooncake", "disaggregation_mooncake_config": P2P}
        if transport == "mooncake"
        else {}
    )
    rng = random.Random(8)
    firsts = [[rng.randrange(1, 500) for _ in range(rng.randint(9, 30))] for _ in range(6)]
    seconds = [p + [rng.randrange(1, 500) for _ in range(8)] for p in firsts]
    fp8 = calibrated(text)
    with LLM(str(tiny_llama), page_size=PAGE, num_kv_pages=256, **fp8) as one:
        want = [
            o.output_ids for o in one.generate(input_ids=firsts + seconds, sampling_params=GREEDY)
        ]
    prefill = LLM(
        str(tiny_llama),
        page_size=PAGE,
        num_kv_pages=256,
        disaggregation_mode="prefill",
        **backend,
        **fp8,
    ).engine
    decode = LLM(
        str(tiny_llama),
        page_size=PAGE,
        num_kv_pages=40,
        disaggregation_mode="decode",
        disaggregation_decode_local_prefill="never",
        disaggregation_decode_enable_radix_cache=True,
        disaggregation_decode_enable_hicache=True,
        hicache_ratio=2,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path / "l3"),
        **backend,
        **fp8,
    ).engine
    try:
        got = [serve_pd(prefill, decode, prompt).output_ids for prompt in firsts + seconds]
        stats = decode.tiers.metrics()
        assert decode.pool.scales == prefill.pool.scales and not decode.pool.scales.is_unit
    finally:
        prefill.close()
        decode.close()
    assert got == want
    assert stats["hicache_hit_tokens_l2"] + stats["hicache_hit_tokens_l3"] > 0


def test_a_pair_of_different_scales_is_refused_naming_both(tiny_llama: Path, text: Path) -> None:
    prefill = LLM(
        str(tiny_llama),
        page_size=PAGE,
        disaggregation_mode="prefill",
        num_kv_pages=64,
        kv_cache_dtype="fp8",
    ).engine
    decode = LLM(
        str(tiny_llama),
        page_size=PAGE,
        disaggregation_mode="decode",
        num_kv_pages=64,
        disaggregation_decode_local_prefill="never",
        **calibrated(text),
    ).engine
    try:
        decode.add_request([5, 6, 7, 8, 9, 10], GREEDY)
        while not (tasks := decode.role.take_tasks()):
            decode.step()
        wire = parse_task(json.dumps(tasks[0].to_json()))
        fingerprint = decode.pool.scales.fingerprint
        with pytest.raises(TaskRefused, match=f"are {fingerprint}, this prefill rank's unit"):
            _task_limits(prefill).check(wire)
    finally:
        prefill.close()
        decode.close()


def test_l3_pages_of_one_set_of_scales_are_never_read_under_another(
    tiny_llama: Path, text: Path, tmp_path: Path
) -> None:
    rng = random.Random(4)
    prompt = [rng.randrange(1, 500) for _ in range(64)]
    flags = L3_FLAGS
    unit, scaled = {"kv_cache_dtype": "fp8"}, calibrated(text)
    for index, (writer, reader) in enumerate(((unit, scaled), (scaled, unit), (scaled, scaled))):
        store = {"hicache_storage_dir": str(tmp_path / f"l3-{index}")}
        with LLM(str(tiny_llama), **flags, **store, **writer) as llm:
            llm.generate(input_ids=[prompt], sampling_params=GREEDY)
            llm.engine.tiers.wait_io()  # type: ignore[attr-defined]
        with LLM(str(tiny_llama), **flags, **store, **reader) as llm:
            (out,) = llm.generate(input_ids=[prompt], sampling_params=GREEDY)
        assert (out.cache_usage.l3_tokens > 0) == (writer is reader), index


def with_scales(model: Path, out: Path, num_layers: int) -> Path:
    """A copy of `model` whose checkpoint also carries KV scales for `num_layers` layers."""
    shutil.copytree(model, out)
    tensors = {
        f"model.layers.{layer}.self_attn.{kind}_scale": torch.tensor(0.01 * (layer + 1) + off)
        for layer in range(num_layers)
        for kind, off in (("k", 0.0), ("v", 0.005))
    }
    save_file(tensors, str(out / "kv_scales.safetensors"))
    return out


def test_a_checkpoints_kv_scales_are_read_for_fp8_only(tiny_llama: Path, tmp_path: Path) -> None:
    num_layers = ModelConfig.from_dir(tiny_llama).num_layers
    model = with_scales(tiny_llama, tmp_path / "scaled", num_layers)
    flags = {"page_size": PAGE, "num_kv_pages": 32}
    with LLM(str(model), kv_cache_dtype="fp8", **flags) as llm:
        scales = llm.engine.pool.scales
        (out,) = llm.generate(input_ids=[[3, 4, 5, 6, 7]], sampling_params=GREEDY)
    assert scales.source == "checkpoint"
    assert scales.k == pytest.approx([0.01 * (i + 1) for i in range(num_layers)])
    assert scales.v == pytest.approx([0.01 * (i + 1) + 0.005 for i in range(num_layers)])
    assert len(out.output_ids) == GREEDY.max_tokens
    with LLM(str(model), **flags) as llm:  # fp32 KV: the scales do not apply
        assert llm.engine.pool.scales.is_unit
    partial = with_scales(tiny_llama, tmp_path / "partial", num_layers - 1)
    with pytest.raises(ConfigError, match=f"layers.{num_layers - 1}.self_attn.k_scale"):
        LLM(str(partial), kv_cache_dtype="fp8", **flags)


def test_calibration_flags_are_checked_naming_the_flag(tiny_llama: Path, tmp_path: Path) -> None:
    model = str(tiny_llama)
    with pytest.raises(ConfigError, match="--kv-scales-calibrate applies to fp8"):
        EngineConfig.from_flags(model=model, kv_scales_calibrate=8, kv_scales_text="x")
    with pytest.raises(ConfigError, match="needs --kv-scales-text"):
        EngineConfig.from_flags(model=model, kv_cache_dtype="fp8", kv_scales_calibrate=8)
    with pytest.raises(ConfigError, match="--kv-scales-text is read only"):
        EngineConfig.from_flags(model=model, kv_cache_dtype="fp8", kv_scales_text="x")
    with pytest.raises(ConfigError, match="--kv-scales-calibrate must be >= 0"):
        EngineConfig.from_flags(model=model, kv_cache_dtype="fp8", kv_scales_calibrate=-1)
    missing = tmp_path / "missing.txt"
    with pytest.raises(ConfigError, match=r"--kv-scales-text .*missing\.txt"):
        LLM(model, kv_cache_dtype="fp8", kv_scales_calibrate=8, kv_scales_text=str(missing))
    short = tmp_path / "short.txt"
    short.write_text("a few words")
    with pytest.raises(ConfigError, match="tokens; --kv-scales-calibrate asks for 5000"):
        LLM(model, kv_cache_dtype="fp8", kv_scales_calibrate=5000, kv_scales_text=str(short))
