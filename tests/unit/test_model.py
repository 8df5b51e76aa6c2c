"""Model parity with transformers (prefill, paged decode, RoPE scaling, Qwen2/Mistral
variants), the tiny-model writer, the tokenizer and the loader's error messages."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvstrata.attention.base import AttentionMetadata, BoundAttention
from kvstrata.attention.torch_ref import TorchAttention
from kvstrata.kvcache.pages import KVPool, PageAllocator
from kvstrata.model.config import ModelConfig
from kvstrata.model.llama import LlamaForCausalLM
from kvstrata.model.loader import load_model
from kvstrata.model.tiny import make_tiny_model
from kvstrata.model.tokenizer import IncrementalDecoder, Tokenizer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

PAGE_SIZE = 8
NUM_PAGES = 32  # 256 token slots: room for the longest prompt below
ATOL = 1e-4


# ---------------------------------------------------------------- helpers


def single_seq_metadata(
    page_table: list[int], kv_len: int, query_len: int, page_size: int = PAGE_SIZE
) -> AttentionMetadata:
    """Metadata for one sequence computing tokens [kv_len - query_len, kv_len) while
    [0, kv_len - query_len) are already in its pages."""
    num_pages = -(-kv_len // page_size)
    slots = [
        page_table[pos // page_size] * page_size + pos % page_size
        for pos in range(kv_len - query_len, kv_len)
    ]
    return AttentionMetadata(
        query_lens=[query_len],
        kv_lens=[kv_len],
        page_tables=[page_table[:num_pages]],
        slot_mapping=torch.tensor(slots, dtype=torch.long),
    )


class PagedSequence:
    """One sequence over a fresh KV pool, computed chunk by chunk through the model."""

    def __init__(self, model: LlamaForCausalLM, kv_dtype: torch.dtype = torch.float32) -> None:
        config = model.config
        self.model = model
        pool = KVPool(
            num_pages=NUM_PAGES,
            page_size=PAGE_SIZE,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=kv_dtype,
            device="cpu",
        )
        self.backend = TorchAttention(pool)
        # Shuffle the free list so the page table is neither contiguous nor ascending.
        allocator = PageAllocator(NUM_PAGES)
        order = torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(7)).tolist()
        all_pages = allocator.alloc(NUM_PAGES)
        allocator.free([all_pages[i] for i in order])
        self.page_table = allocator.alloc(NUM_PAGES)
        self.num_computed_tokens = 0

    @torch.inference_mode()
    def extend(self, new_token_ids: list[int]) -> torch.Tensor:
        """Compute the next tokens; returns their fp32 logits [len(new_token_ids), vocab]."""
        start, end = self.num_computed_tokens, self.num_computed_tokens + len(new_token_ids)
        meta = single_seq_metadata(self.page_table, kv_len=end, query_len=len(new_token_ids))
        hidden = self.model(
            torch.tensor(new_token_ids, dtype=torch.long),
            torch.arange(start, end, dtype=torch.long),
            BoundAttention(self.backend, meta),
        )
        self.num_computed_tokens = end
        return self.model.compute_logits(hidden)


def prompt_ids(length: int, vocab_size: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


@torch.inference_mode()
def hf_logits(hf_model: Any, token_ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([token_ids])).logits[0].float()


def load_hf(model_dir: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def edit_config(model_dir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2))


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch) for arch in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def models(tiny_dirs: dict[str, Path]) -> dict[str, tuple[LlamaForCausalLM, Any]]:
    """arch -> (our model, the transformers model) on the same checkpoint, fp32."""
    return {
        arch: (load_model(path, torch.float32, "cpu"), load_hf(path))
        for arch, path in tiny_dirs.items()
    }


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("length", [1, 7, 33, 100])
def test_prefill_logits_match_transformers(models: dict, arch: str, length: int) -> None:
    ours, hf = models[arch]
    token_ids = prompt_ids(length, ours.config.vocab_size, seed=length)
    logits = PagedSequence(ours).extend(token_ids)
    assert logits.dtype == torch.float32
    assert logits.shape == (length, ours.config.vocab_size)
    assert max_diff(logits, hf_logits(hf, token_ids)) < ATOL


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("length", [2, 9, 33, 100])
def test_decode_steps_read_cached_pages(models: dict, arch: str, length: int) -> None:
    ours, hf = models[arch]
    token_ids = prompt_ids(length, ours.config.vocab_size, seed=length + 1)
    reference = hf_logits(hf, token_ids)
    seq = PagedSequence(ours)
    seq.extend(token_ids[: length - 1])
    last = seq.extend(token_ids[length - 1 :])
    assert last.shape == (1, ours.config.vocab_size)
    assert max_diff(last[0], reference[-1]) < ATOL


def test_chunked_prefill_then_decode_matches_one_shot(models: dict) -> None:
    ours, hf = models["llama"]
    token_ids = prompt_ids(40, ours.config.vocab_size, seed=3)
    reference = hf_logits(hf, token_ids)
    seq = PagedSequence(ours)
    chunks = [seq.extend(token_ids[a:b]) for a, b in [(0, 5), (5, 21), (21, 37)]]
    chunks += [seq.extend([t]) for t in token_ids[37:]]
    assert max_diff(torch.cat(chunks), reference) < ATOL


ROPE_VARIANTS: dict[str, dict[str, Any]] = {
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    # original_max_position_embeddings 64 puts the tiny model's 8 frequencies in all three
    # llama3 bands (wavelengths 6 .. 2e4 tokens against 16 and 64).
    "llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "yarn": {
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
        }
    },
    # transformers 5 layout: theta and scaling both inside rope_parameters.
    "llama3_rope_parameters": {
        "rope_theta": None,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 5000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 2.0,
            "original_max_position_embeddings": 32,
        },
    },
}


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_scaling_matches_transformers(
    models: dict, tiny_dirs: dict[str, Path], tmp_path: Path, variant: str
) -> None:
    model_dir = copy_model(tiny_dirs["llama"], tmp_path / variant)

    def apply(config: dict[str, Any]) -> None:
        for key, value in ROPE_VARIANTS[variant].items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value

    edit_config(model_dir, apply)
    ours = load_model(model_dir, torch.float32, "cpu")
    assert ours.config.rope_scaling is not None
    if "rope_parameters" in ROPE_VARIANTS[variant]:
        assert ours.config.rope_theta == 5000.0
    token_ids = prompt_ids(100, ours.config.vocab_size, seed=5)
    logits = PagedSequence(ours).extend(token_ids)
    assert max_diff(logits, hf_logits(load_hf(model_dir), token_ids)) < ATOL
    # The scaling must matter, or the comparison above proves nothing.
    unscaled = PagedSequence(models["llama"][0]).extend(token_ids)
    assert max_diff(logits, unscaled) > 1e-2


def _as_qwen2(model_dir: Path) -> None:
    # Qwen2 always has q/k/v biases and no attention_bias key; add random ones.
    edit_config(
        model_dir, lambda c: c.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    )
    weights = load_file(model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(11)
    for name in list(weights):
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            out_features = weights[name].shape[0]
            bias = 0.2 * torch.randn(out_features, generator=generator)
            weights[name.replace(".weight", ".bias")] = bias
    save_file(weights, model_dir / "model.safetensors")


def _as_mistral(model_dir: Path) -> None:
    edit_config(
        model_dir,
        lambda c: c.update(
            architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None
        ),
    )


@pytest.mark.parametrize("variant", ["qwen2", "mistral"])
def test_other_architectures_match_transformers(
    tiny_dirs: dict[str, Path], tmp_path: Path, variant: str
) -> None:
    model_dir = copy_model(tiny_dirs["llama"], tmp_path / variant)
    {"qwen2": _as_qwen2, "mistral": _as_mistral}[variant](model_dir)
    ours = load_model(model_dir, torch.float32, "cpu")
    assert ours.config.attention_bias == (variant == "qwen2")
    token_ids = prompt_ids(33, ours.config.vocab_size, seed=9)
    logits = PagedSequence(ours).extend(token_ids)
    assert max_diff(logits, hf_logits(load_hf(model_dir), token_ids)) < ATOL


def test_bf16_load_casts_weights_and_keeps_rope_fp32(tiny_dirs: dict[str, Path]) -> None:
    model = load_model(tiny_dirs["qwen3"], torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    logits = PagedSequence(model, kv_dtype=torch.bfloat16).extend([1, 2, 3])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


# ---------------------------------------------------------------- tiny model + tokenizer


def test_make_tiny_model_is_deterministic(tmp_path: Path) -> None:
    first = make_tiny_model(tmp_path / "a", "qwen3", seed=0)
    second = make_tiny_model(tmp_path / "b", "qwen3", seed=0)
    other = make_tiny_model(tmp_path / "c", "qwen3", seed=1)
    names = sorted(p.name for p in first.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    weights, other_weights = (
        load_file(first / "model.safetensors"),
        load_file(other / "model.safetensors"),
    )
    assert weights.keys() == other_weights.keys()
    assert all(not torch.equal(weights[k], other_weights[k]) for k in weights)


def test_tiny_configs(tiny_dirs: dict[str, Path]) -> None:
    llama = ModelConfig.from_dir(tiny_dirs["llama"])
    qwen3 = ModelConfig.from_dir(tiny_dirs["qwen3"])
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim) == (4, 2, 16)
    assert not llama.tie_word_embeddings and not llama.qk_norm
    assert qwen3.tie_word_embeddings and qwen3.qk_norm
    tokenizer = Tokenizer(tiny_dirs["llama"])
    assert llama.vocab_size == tokenizer.vocab_size
    im_end, endoftext = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")
    assert llama.eos_token_ids == (im_end, endoftext)  # config's, then generation_config's
    assert tokenizer.eos_token_ids == (im_end, endoftext)


TEXTS = [
    "Hello! How can I help you today?",
    "héllo wörld 世界 🙂 x",
    "",
    "  two  spaces\n\tand tab",
]


def test_tokenizer_matches_transformers(tiny_dirs: dict[str, Path]) -> None:
    ours = Tokenizer(tiny_dirs["llama"])
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"]
        assert ours.decode(ids) == text == hf.decode(ids)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Tell me a story 🙂"},
    ]
    for add_generation_prompt in (True, False):
        expected = hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        assert ours.apply_chat_template(messages, add_generation_prompt) == list(expected)
    assert ours.render_chat(messages[:1]).endswith("<|im_start|>assistant\n")


def test_tokenizer_without_chat_template(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = copy_model(tiny_dirs["llama"], tmp_path / "plain")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(model_dir).apply_chat_template([{"role": "user", "content": "hi"}])


def test_incremental_decoder_holds_back_partial_characters(tiny_dirs: dict[str, Path]) -> None:
    tokenizer = Tokenizer(tiny_dirs["llama"])
    text = "Hi 世界🙂 ok<|im_end|> é"
    ids = tokenizer.encode(text)
    decoder = IncrementalDecoder(tokenizer)
    deltas = [decoder.step(ids[:n]) for n in range(1, len(ids) + 1)]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) + decoder.flush() == tokenizer.decode(ids) == decoder.text
    # Each multi-byte character spans several byte tokens, so some steps emit nothing.
    assert "" in deltas and "世" in deltas
    # A generation cut inside a character flushes the replacement char at the end.
    cut = IncrementalDecoder(tokenizer)
    partial = tokenizer.encode("🙂")[:2]
    assert cut.step(partial) == ""
    assert cut.flush() == tokenizer.decode(partial)


# ---------------------------------------------------------------- errors


def test_loader_errors_name_the_problem(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(tmp_path / "nope", torch.float32, "cpu")

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(empty, torch.float32, "cpu")

    gpt2 = copy_model(tiny_dirs["llama"], tmp_path / "gpt2")
    edit_config(gpt2, lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(gpt2, torch.float32, "cpu")

    missing = copy_model(tiny_dirs["llama"], tmp_path / "missing")
    weights = load_file(missing / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, missing / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weight.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(missing, torch.float32, "cpu")

    extra = copy_model(tiny_dirs["llama"], tmp_path / "extra")
    weights = load_file(extra / "model.safetensors")
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(weights, extra / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"does not use: model\.layers\.0\.self_attn\.q_proj\.bias"
    ):
        load_model(extra, torch.float32, "cpu")

    wrong_shape = copy_model(tiny_dirs["llama"], tmp_path / "shape")
    edit_config(wrong_shape, lambda c: c.update(intermediate_size=96))
    with pytest.raises(ValueError, match=r"gate_proj\.weight.*shape"):
        load_model(wrong_shape, torch.float32, "cpu")

    no_weights = copy_model(tiny_dirs["llama"], tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(no_weights, torch.float32, "cpu")

    corrupt = copy_model(tiny_dirs["llama"], tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        load_model(corrupt, torch.float32, "cpu")


def test_sharded_checkpoint_and_untied_without_lm_head(
    models: dict, tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    # Split the llama checkpoint in two shards with an index; drop lm_head and mark the
    # model untied: the loader must fall back to the embedding as the head.
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(tiny_dirs["qwen3"] / name, sharded / name)
    edit_config(sharded, lambda c: c.update(tie_word_embeddings=False))
    weights = load_file(tiny_dirs["qwen3"] / "model.safetensors")
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[:7],
        "model-00002-of-00002.safetensors": names[7:],
    }
    for file_name, shard_names in shards.items():
        save_file({n: weights[n] for n in shard_names}, sharded / file_name)
    weight_map = {n: f for f, shard_names in shards.items() for n in shard_names}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (sharded / "stray.safetensors").write_bytes(b"ignored: not in the index")

    model = load_model(sharded, torch.float32, "cpu")
    assert model.lm_head is None
    token_ids = prompt_ids(7, model.config.vocab_size)
    expected = PagedSequence(models["qwen3"][0]).extend(token_ids)
    assert torch.equal(PagedSequence(model).extend(token_ids), expected)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.pop("hidden_size"), "hidden_size"),
        (lambda c: c.pop("architectures"), "architectures"),
        (lambda c: c.update(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "longrope"),
        (lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 2.0}), "original_max"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
        (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
        (lambda c: c.update(torch_dtype="int8"), "int8"),
    ],
)
def test_config_errors(tiny_dirs: dict[str, Path], edit: Callable, message: str) -> None:
    config = json.loads((tiny_dirs["llama"] / "config.json").read_text())
    edit(config)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(config)


def test_config_parsing_details() -> None:
    base = {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
        "eos_token_id": [3, 4],
        "sliding_window": 64,
        "dtype": "bfloat16",
    }
    config = ModelConfig.from_hf_config(base)
    assert config.head_dim == 8 and config.num_kv_heads == 4
    assert config.attention_bias and not config.qk_norm
    assert config.eos_token_ids == (3, 4)
    assert config.torch_dtype == torch.bfloat16
    assert config.max_context_len == 128  # Qwen ignores sliding_window unless enabled
    mistral = ModelConfig.from_hf_config({**base, "architectures": ["MistralForCausalLM"]})
    assert mistral.max_context_len == 64 and not mistral.attention_bias
