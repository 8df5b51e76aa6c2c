"""GGUF loading without the real model: tiny random checkpoints written as GGUF files (the
llama.cpp conventions: names, reversed shapes, permuted llama q/k rows) load to the same
logits, tokens and chat prompts as their safetensors originals; quantized tensors load
as their dequantized values; what cannot be loaded is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_model import PagedSequence, max_diff, prompt_ids

from kvstrata.config import ConfigError, EngineConfig
from kvstrata.engine.parts import resolve_model_source
from kvstrata.model import gguf as kgguf
from kvstrata.model.gguf import GgufError, permute_rotary_rows
from kvstrata.model.identity import model_identity
from kvstrata.model.loader import load_model
from kvstrata.model.tiny import make_tiny_model
from kvstrata.model.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")

HF_TO_GGUF = {hf: name for name, hf in kgguf._GLOBAL_TENSORS.items()}
LAYER_HF_TO_GGUF = {hf: name for name, hf in kgguf._LAYER_TENSORS.items()}
ARCH_OF = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{LAYER_HF_TO_GGUF[rest]}"


def write_gguf(model_dir: Path, path: Path, qtype: str = "F32", **overrides: object) -> Path:
    """`model_dir` (a tiny safetensors model) as the GGUF file llama.cpp would write.
    `overrides`: metadata to change (arch=..., tokenizer_model=..., tensor_type=...)."""
    hf = json.loads((model_dir / "config.json").read_text())
    arch = str(overrides.get("arch", ARCH_OF[hf["architectures"][0]]))
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_key_length(hf["head_dim"])
    writer.add_rope_freq_base(hf.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    ids = tok["model"]["vocab"] | {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = [token for token, _ in sorted(ids.items(), key=lambda item: item[1])]
    special = {t["content"] for t in tok["added_tokens"]}
    writer.add_tokenizer_model(str(overrides.get("tokenizer_model", "gpt2")))
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])
    writer.add_token_merges(
        [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    )
    writer.add_bos_token_id(hf["bos_token_id"])
    writer.add_eos_token_id(hf["eos_token_id"])
    writer.add_chat_template(Tokenizer(model_dir).chat_template)
    weights = load_file(str(model_dir / "model.safetensors"))
    for name, tensor in weights.items():
        values = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            key = "num_attention_heads" if "q_proj" in name else "num_key_value_heads"
            values = permute_rotary_rows(values, hf[key])
        kind = gguf.GGMLQuantizationType[str(overrides.get("tensor_type", qtype))]
        if values.ndim == 1 or kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), values)
        elif kind == gguf.GGMLQuantizationType.I8:
            writer.add_tensor(gguf_name(name), values.astype(np.int8))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-gguf")
    return {arch: make_tiny_model(root / arch, arch) for arch in ("llama", "qwen3")}


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_loads_like_its_safetensors_original(
    tiny: dict[str, Path], tmp_path: Path, arch: str
) -> None:
    path = write_gguf(tiny[arch], tmp_path / f"{arch}.gguf")
    ours, original = (
        load_model(path, torch.float32, "cpu"),
        load_model(tiny[arch], torch.float32, "cpu"),
    )
    ids = prompt_ids(40, original.config.vocab_size, seed=5)
    assert max_diff(PagedSequence(ours).extend(ids), PagedSequence(original).extend(ids)) == 0.0
    text = "Hello, world! 12345 héllo\n\n  spaces"
    assert Tokenizer(path).encode(text) == Tokenizer(tiny[arch]).encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert Tokenizer(path).apply_chat_template(chat) == Tokenizer(tiny[arch]).apply_chat_template(
        chat
    )


def test_quantized_tensors_load_as_their_dequantized_values(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    path = write_gguf(tiny["llama"], tmp_path / "q8.gguf", qtype="Q8_0")
    loaded = load_model(path, torch.float32, "cpu").state_dict()
    original = load_file(str(tiny["llama"] / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight"
    expected = gguf.quants.dequantize(
        gguf.quants.quantize(original[name].float().numpy(), gguf.GGMLQuantizationType.Q8_0),
        gguf.GGMLQuantizationType.Q8_0,
    )
    assert torch.equal(loaded[name], torch.from_numpy(expected))
    assert 0 < max_diff(loaded[name], original[name].float()) < 0.05


def test_engine_config_takes_a_gguf_file_and_identity_follows_its_contents(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    path = write_gguf(tiny["llama"], tmp_path / "a.gguf")
    config = resolve_model_source(EngineConfig.from_flags(model=str(path)))
    assert (Path(config.model.path) / "config.json").is_file()  # served from its directory
    assert model_identity(path) == model_identity(config.model.path)
    other = write_gguf(tiny["qwen3"], tmp_path / "b.gguf")
    assert model_identity(other) != model_identity(path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"arch": "gpt2"}, "unsupported GGUF architecture 'gpt2'"),
        ({"tokenizer_model": "llama"}, "tokenizer model 'llama' is not supported"),
        ({"tensor_type": "I8"}, "quantization type I8"),
    ],
)
def test_refuses_what_it_cannot_load_by_name(
    tiny: dict[str, Path], tmp_path: Path, override: dict[str, str], message: str
) -> None:
    path = write_gguf(tiny["llama"], tmp_path / "bad.gguf", **override)
    with pytest.raises(GgufError, match=message):
        load_model(path, torch.float32, "cpu")
    with pytest.raises(ConfigError, match=message):
        resolve_model_source(EngineConfig.from_flags(model=str(path)))
