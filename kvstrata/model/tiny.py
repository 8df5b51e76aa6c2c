"""Writes a tiny random Llama or Qwen3 model in Hugging Face layout (config, safetensors,
byte-level BPE tokenizer with a ChatML template) for tests and the demo, or a random model
of a real model's shapes (`--preset`, for benchmarks; bf16, sharded, generated on the GPU
when there is one). Deterministic: the same arguments (and device type) always produce
byte-identical files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvstrata.model.config import ModelConfig
from kvstrata.model.llama import LlamaForCausalLM
from kvstrata.model.presets import PRESET_COMMON, PRESETS

TinyArch = Literal["llama", "qwen3"]

BPE_VOCAB_SIZE = 512  # byte alphabet (256) + merges; special tokens come after these ids
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Init std per parameter kind. Larger than a real model's 0.02 on purpose: the next-token
# distribution comes out peaked, so greedy decoding has a clear winner at almost every step
# and tests can demand exact token equality across batching and caching.
# The tied model (qwen3) reads logits off its embedding, whose std therefore also sets
# the logit scale and how strongly the model repeats its input token: 0.6 balances
# peakedness against degenerate repetition.
EMBED_STD: dict[str, float] = {"llama": 1.0, "qwen3": 0.6}
LINEAR_STD = 0.2
LM_HEAD_STD = 1.0
NORM_JITTER_STD = 0.1  # norm weights are 1 + jitter, so a norm that is not loaded shows

CORPUS = """\
The cache remembers what the model has already read, so the next turn starts quickly.
A page holds sixteen tokens of keys and values for every layer of the model.
When memory runs short, the oldest unused pages are evicted to the host.
Pages on the host can be copied back to the device before they are needed.
The router sends each request to the worker that already holds its longest prefix.
Prefill reads the whole prompt at once; decode adds one token at a time.
A user asked for a short story about a lighthouse keeper and her cat.
The keeper climbed the stairs every evening to light the great lamp.
Her cat watched the ships pass by and counted them in its sleepy way.
One stormy night a small boat lost its way near the rocky shore.
The light swept over the waves and showed the sailors the safe harbor.
In the morning the sailors brought fresh bread and honey to the tower.
Numbers appear in text too: 1, 2, 3, 10, 42, 100, 2024 and 3.14159.
Questions end with a question mark. Do they? Yes, they do!
Lists use commas, semicolons; colons: and dashes - quite often.
Quotes look like "this" or 'this', and parentheses (like these) nest.
Python code may appear: def add(a, b): return a + b
The quick brown fox jumps over the lazy dog near the river bank.
She sells sea shells by the sea shore, and the shells are surely sea shells.
Every morning the baker opens the shop and the street smells of warm bread.
Children walk to school with bright bags and talk about their games.
The teacher writes a simple sum on the board and asks who knows the answer.
Rain falls softly on the roof while the kettle sings in the kitchen.
Mountains rise far to the north, covered with snow for most of the year.
A train crosses the valley twice a day, carrying people and letters.
The library is quiet, and the old books smell of dust and time.
Good software is simple to read, easy to test and hard to misuse.
Write the test first, then make it pass, then make the code clear.
A server answers many requests at once and must never lose one.
Streaming sends each new piece of text as soon as it is ready.
Stop strings end the answer early when the model writes them.
The system prompt tells the assistant how to behave in the conversation.
Hello! How can I help you today? I would like to know the weather.
The weather is sunny with a light breeze and a few clouds in the afternoon.
Thank you very much. You are welcome, have a nice day.
Tokens are pieces of words; common words become a single token.
Rare words are split into smaller pieces, down to single bytes if needed.
The model predicts the next token from all the tokens before it.
Greedy decoding always picks the most likely token, so it is repeatable.
Sampling with a temperature adds variety, and a seed makes it repeatable too.
"""


PRESET_STD = 0.02  # a real model's init scale: activations stay finite in bf16
SHARD_BYTES = 4 << 30


def make_tiny_model(
    out_dir: str | Path,
    arch: TinyArch = "llama",
    seed: int = 0,
    preset: str | None = None,
    device: str | None = None,
) -> Path:
    """Write a tiny random `arch` model to `out_dir` (created if needed); returns it.
    llama: untied LM head; qwen3: q/k norm and tied embeddings. With `preset` (a key of
    PRESETS; implies qwen3) the model has that release's shapes and bf16 weights drawn
    on `device` (default: cuda if present, else cpu)."""
    if arch not in ("llama", "qwen3"):
        raise ValueError(f"unknown tiny arch {arch!r}; expected 'llama' or 'qwen3'")
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    if preset is not None:
        arch = "qwen3"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer()
    token_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    bos_id, eos_id = token_ids["<|endoftext|>"], token_ids["<|im_end|>"]
    assert bos_id is not None and eos_id is not None, "the trained vocabulary has both"
    hf_config = tiny_hf_config(arch, tokenizer.get_vocab_size(), bos_id, eos_id)
    if preset is not None:
        hf_config.update(PRESET_COMMON, **PRESETS[preset])

    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "config.json", hf_config)
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config())
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": bos_id, "eos_token_id": [eos_id, bos_id], "pad_token_id": bos_id},
    )
    model_config = ModelConfig.from_hf_config(hf_config)
    if preset is not None:
        write_preset_weights(out_dir, model_config, seed, device)
        return out_dir
    weights = random_weights(model_config, seed, EMBED_STD[arch])
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def write_preset_weights(out_dir: Path, config: ModelConfig, seed: int, device: str | None) -> None:
    """bf16 N(0, PRESET_STD) weights (norms 1) drawn on `device`, written as <= 4 GiB
    shards with a Hugging Face index."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in LlamaForCausalLM(config).named_parameters()}
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, shape in shapes.items():
        nbytes = 2 * shape.numel()
        if shards[-1] and shard_bytes + nbytes > SHARD_BYTES:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += nbytes
    generator = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    for index, names in enumerate(shards):
        file_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for name in names:
            if name.endswith("norm.weight"):
                value = torch.ones(shapes[name], dtype=torch.bfloat16)
            else:
                value = torch.randn(
                    shapes[name], generator=generator, device=device, dtype=torch.float32
                )
                value = value.mul_(PRESET_STD).to(torch.bfloat16).cpu()
            tensors[name] = value
            weight_map[name] = file_name
        save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
    total_bytes = sum(2 * shape.numel() for shape in shapes.values())
    _write_json(
        out_dir / "model.safetensors.index.json",
        {"metadata": {"total_size": total_bytes}, "weight_map": weight_map},
    )


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on CORPUS (deterministic: the trainer breaks ties by pair
    order, and the corpus is fixed), then the special tokens on top."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def tiny_hf_config(arch: TinyArch, vocab_size: int, bos_id: int, eos_id: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen3ForCausalLM"],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": arch == "qwen3",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": bos_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if arch == "llama":
        config["mlp_bias"] = False
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=2)
    return config


def random_weights(config: ModelConfig, seed: int, embed_std: float) -> dict[str, torch.Tensor]:
    """One fp32 tensor per model parameter, drawn in the model's parameter order from a
    generator seeded with `seed`."""
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in LlamaForCausalLM(config).named_parameters()}
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + NORM_JITTER_STD * noise
        elif name.endswith("bias"):
            weights[name] = LINEAR_STD * noise
        elif name == "model.embed_tokens.weight":
            weights[name] = embed_std * noise
        elif name == "lm_head.weight":
            weights[name] = LM_HEAD_STD * noise
        else:
            weights[name] = LINEAR_STD * noise
    return weights


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
