"""The model identity covers the weights' contents (kvstrata/model/identity.py): two
same-shape checkpoints never share an L3 namespace, a changed tensor byte changes the
identity even with its mtime restored, and the sidecar makes a second start read no
weight byte, also when the model dir is not writable or several ranks start at once."""

from __future__ import annotations

import json
import os
import random
import threading
from pathlib import Path

import pytest
import torch

from kvstrata import LLM, SamplingParams
from kvstrata.config import EngineConfig
from kvstrata.kvcache.factory import namespace_of
from kvstrata.model import identity
from kvstrata.model.identity import SIDECAR_NAME, model_identity, sidecar_paths
from kvstrata.model.tiny import make_tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
WEIGHTS = "model.safetensors"


@pytest.fixture
def two_seeds(tmp_path: Path) -> tuple[Path, Path]:
    return (
        make_tiny_model(tmp_path / "seed0", "llama", seed=0),
        make_tiny_model(tmp_path / "seed7", "llama", seed=7),
    )


@pytest.fixture
def counted_hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every file whose bytes `model_identity` reads, in order."""
    read: list[Path] = []
    real = identity.file_content_hash

    def counting(path: Path) -> str:
        read.append(path)
        return real(path)

    monkeypatch.setattr(identity, "file_content_hash", counting)
    return read


def test_same_config_and_sizes_different_weights_get_different_namespaces(
    two_seeds: tuple[Path, Path],
) -> None:
    a, b = two_seeds
    # The defect's precondition: nothing but the tensor bytes tells them apart.
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    assert (a / WEIGHTS).stat().st_size == (b / WEIGHTS).stat().st_size
    assert model_identity(a) != model_identity(b)
    namespaces = {
        namespace_of(EngineConfig.from_flags(model=str(m)), torch.float32) for m in (a, b)
    }
    assert len(namespaces) == 2


def test_one_changed_tensor_byte_changes_the_identity_even_with_mtime_restored(
    tmp_path: Path,
) -> None:
    model = make_tiny_model(tmp_path / "m", "llama", seed=0)
    before = model_identity(model)
    path = model / WEIGHTS
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # the last tensor's data, past the header
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as `cp -p` or `touch -d` do
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert model_identity(model) != before


def test_a_second_start_reads_no_weight_byte(tmp_path: Path, counted_hashes: list[Path]) -> None:
    model = make_tiny_model(tmp_path / "m", "llama", seed=0)
    first = model_identity(model)
    assert counted_hashes == [model / WEIGHTS]
    body = json.loads((model / SIDECAR_NAME).read_text())
    assert set(body["files"]) == {WEIGHTS}
    assert model_identity(model) == first
    assert counted_hashes == [model / WEIGHTS]  # the sidecar answered
    (model / SIDECAR_NAME).write_text("{torn")  # an unreadable sidecar is a re-hash
    assert model_identity(model) == first
    assert len(counted_hashes) == 2


def test_a_model_dir_that_cannot_hold_the_sidecar_uses_the_user_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, counted_hashes: list[Path]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = make_tiny_model(tmp_path / "m", "llama", seed=0)
    reference = model_identity(make_tiny_model(tmp_path / "copy", "llama", seed=0))
    # A directory where the lock file must go: opening it for writing fails (also for
    # root, whom a read-only mode would not stop).
    (model / (SIDECAR_NAME + ".lock")).mkdir()
    assert model_identity(model) == reference
    cached = sidecar_paths(model)[1]
    assert cached.is_relative_to(tmp_path / "cache") and cached.is_file()
    assert not (model / SIDECAR_NAME).exists()
    num_reads = len(counted_hashes)
    assert model_identity(model) == reference
    assert len(counted_hashes) == num_reads


def test_ranks_starting_at_once_hash_each_file_once(
    tmp_path: Path, counted_hashes: list[Path]
) -> None:
    model = make_tiny_model(tmp_path / "m", "llama", seed=0)
    results: list[str] = []
    start = threading.Barrier(4)

    def rank() -> None:
        start.wait()
        results.append(model_identity(model))

    threads = [threading.Thread(target=rank) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len(set(results)) == 1
    assert counted_hashes == [model / WEIGHTS]


def hicache_llm(model: Path, directory: Path) -> LLM:
    return LLM(
        str(model),
        page_size=4,
        num_kv_pages=256,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(directory),
        hicache_storage_prefetch_policy="wait_complete",
        hicache_prefetch_threshold=4,
    )


def test_a_same_shape_checkpoint_does_not_read_the_other_ones_l3_pages(
    two_seeds: tuple[Path, Path], tmp_path: Path
) -> None:
    a, b = two_seeds
    rng = random.Random(0)
    batch = [[rng.randrange(500) for _ in range(70)] for _ in range(2)]
    writer = hicache_llm(a, tmp_path / "l3")
    written = [writer.generate(input_ids=[p], sampling_params=GREEDY)[0] for p in batch]
    writer.engine.tiers.wait_io()
    assert sorted((tmp_path / "l3").rglob("*.kvpage"))  # pages are there to be misread
    reference = LLM(str(b), page_size=4, disable_radix_cache=True)
    expected = [o.output_ids for o in reference.generate(input_ids=batch, sampling_params=GREEDY)]
    assert expected != [o.output_ids for o in written]  # shared pages would be wrong tokens
    reader = hicache_llm(b, tmp_path / "l3")
    outs = [reader.generate(input_ids=[p], sampling_params=GREEDY)[0] for p in batch]
    assert [o.cache_usage.l3_tokens for o in outs] == [0, 0]
    assert reader.engine.tiers.stats.hit_tokens_l3 == 0
    assert [o.output_ids for o in outs] == expected
