"""CPU checks of the pure logic behind the GPU path: step inputs (slots, decode rows,
packed layout tensors), CUDA-graph buckets and padding, split-K fan-out, backend choice
and the activation reserve of the KV pool sizing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstrata.attention import make_attention_backend
from kvstrata.attention.torch_ref import TorchAttention
from kvstrata.config import ConfigError, EngineConfig
from kvstrata.core import Batch, Request, SamplingParams, ScheduledRequest
from kvstrata.engine.cuda_graph import graph_batch_sizes, padded_batch_size
from kvstrata.engine.memory import activation_reserve_bytes
from kvstrata.engine.runner import (
    build_step_inputs,
    decode_step_inputs,
    paged_tensors_host,
    unpack_paged_tensors,
)
from kvstrata.kvcache.pages import KVPool
from kvstrata.model.config import ModelConfig
from kvstrata.model.tiny import make_tiny_model


def request(prompt: list[int], output: list[int], page_ids: list[int]) -> Request:
    req = Request("r", prompt, SamplingParams())
    req.output_ids = list(output)
    req.page_ids = page_ids
    return req


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(10) == [1, 2, 4, 8, 10]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_padded_batch_size() -> None:
    sizes = graph_batch_sizes(40)
    assert [padded_batch_size(sizes, n) for n in (1, 3, 8, 9, 17, 33, 40)] == [
        1, 4, 8, 16, 32, 40, 40,
    ]  # fmt: skip
    assert padded_batch_size(sizes, 41) is None


def test_step_inputs_slots_positions_and_sample_rows() -> None:
    page_size = 4
    decode = request([1, 2, 3, 4, 5], [6], page_ids=[7, 2])  # token 5 (the 6) is new
    prefill = request(list(range(10, 20)), [], page_ids=[5, 0, 9])  # chunk [2, 9)
    batch = Batch(
        [ScheduledRequest(decode, 5, 1, samples=True), ScheduledRequest(prefill, 2, 7, False)]
    )
    step = build_step_inputs(batch, page_size)
    assert step.input_ids == [6, *range(12, 19)]
    assert step.positions == [5, *range(2, 9)]
    # decode: position 5 -> page 2, offset 1; prefill: 2,3 on page 5; 4..7 on 0; 8 on 9.
    assert step.slots == [9, 22, 23, 0, 1, 2, 3, 36]
    assert step.query_lens == [1, 7] and step.kv_lens == [6, 9]
    assert step.page_tables == [[7, 2], [5, 0, 9]]
    assert step.sample_rows == [0]
    assert step.num_decodes == 1 and not step.is_decode

    packed = paged_tensors_host(step)
    tensors = unpack_paged_tensors(packed, step)
    assert tensors.query_start_loc.tolist() == [0, 1, 8]
    assert tensors.seq_lens.tolist() == [6, 9]
    assert tensors.page_table.tolist() == [[7, 2, 0], [5, 0, 9]]
    assert tensors.num_decodes == 1 and tensors.max_query_len == 7


def test_decode_step_is_graphable() -> None:
    reqs = [request([1, 2], [3], [0]), request([4], [5, 6], [1])]
    batch = Batch([ScheduledRequest(r, r.num_tokens - 1, 1, samples=True) for r in reqs])
    step = build_step_inputs(batch, page_size=4)
    assert step.is_decode and step.num_decodes == 2
    assert step.input_ids == [3, 6] and step.slots == [2, 6]


def test_decode_rows_match_the_general_path_wherever_they_sit() -> None:
    # Leading decodes are built a list at a time; a decode after a prefill chunk takes
    # the row-by-row path. Both must give the rows of a batch of one item each.
    page_size = 4
    first = request([1, 2, 3], [], page_ids=[4])  # decode of its last prompt token
    second = request([1, 2, 3, 4], [8, 9, 10, 11, 12], page_ids=[5, 6, 7])  # position 8
    chunk = request(list(range(10, 20)), [], page_ids=[3, 2])  # chunk [0, 6)
    last = request([5, 6], [7], page_ids=[1, 0])  # a spare page: the row is its first
    items = [
        ScheduledRequest(first, 2, 1, samples=True),
        ScheduledRequest(second, 8, 1, samples=True),
        ScheduledRequest(chunk, 0, 6, samples=False),
        ScheduledRequest(last, 2, 1, samples=True),
    ]
    step = build_step_inputs(Batch(items), page_size)
    one_by_one = [build_step_inputs(Batch([item]), page_size) for item in items]
    assert step.input_ids == [3, 12, *range(10, 16), 7]
    assert step.input_ids == [t for one in one_by_one for t in one.input_ids]
    assert step.positions == [t for one in one_by_one for t in one.positions]
    assert step.slots == [18, 28, 12, 13, 14, 15, 8, 9, 6]
    assert step.slots == [s for one in one_by_one for s in one.slots]
    assert step.kv_lens == [3, 9, 6, 3] and step.query_lens == [1, 1, 6, 1]
    assert step.page_tables == [[4], [5, 6, 7], [3, 2], [1]]
    assert step.sample_rows == [0, 1, 8]
    # A decode row holding exactly its request's pages is that very list (the graph
    # runner's persistent page table keys rows by it).
    assert step.page_tables[1] is second.page_ids
    overlapped = decode_step_inputs(items[:2], page_size)  # token ids still on the device
    assert overlapped.input_ids == [0, 0] and overlapped.slots == step.slots[:2]
    assert overlapped.page_tables == step.page_tables[:2]


def test_split_fan_out_is_a_power_of_two_set_by_batch_shape() -> None:
    triton_paged = pytest.importorskip("kvstrata.attention.triton_paged")
    splits = triton_paged.num_decode_splits
    assert splits(1, 8, num_sms=132) == 32  # 8 programs: fan out to the cap
    assert splits(4, 8, num_sms=132) == 16  # 32 programs: 264 / 32 -> 9 -> 16
    assert splits(256, 8, num_sms=132) == 1  # 2048 programs already fill the GPU


def test_backend_choice(tiny_llama: Path) -> None:
    pool = KVPool(2, 4, 1, 1, 4, torch.float32, "cpu")
    assert isinstance(make_attention_backend("auto", pool, torch.device("cpu")), TorchAttention)
    assert isinstance(make_attention_backend("torch", pool, torch.device("cpu")), TorchAttention)
    with pytest.raises(ConfigError, match="--attention-backend"):
        make_attention_backend("triton", pool, torch.device("cpu"))


def test_activation_reserve_grows_with_the_token_budget(tiny_llama: Path) -> None:
    model = ModelConfig.from_dir(tiny_llama)
    small = EngineConfig.from_flags(model=str(tiny_llama), max_num_batched_tokens=256)
    large = EngineConfig.from_flags(model=str(tiny_llama), max_num_batched_tokens=8192)
    assert activation_reserve_bytes(large, model) > activation_reserve_bytes(small, model) > 0


def test_preset_is_a_qwen3_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvstrata.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["make-tiny-model", str(tmp_path), "--preset", "qwen3-0.6b", "--arch", "llama"])
    assert exit_info.value.code == 2
    assert "--preset qwen3-0.6b is a qwen3 model" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown preset"):
        make_tiny_model(tmp_path, preset="qwen3-70b")
