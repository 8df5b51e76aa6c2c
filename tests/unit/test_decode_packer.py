"""The CUDA-graph decode input packer on CPU: its persistent page table holds each row's
page list exactly (after growth, requests joining and leaving, preemption and
readmission, aborts), whether driven by hand or by a real engine's decode steps; and its
int64 inputs and sequence lengths are padded for the captured batch size."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvstrata import LLM, SamplingParams
from kvstrata.engine import runner as runner_module
from kvstrata.engine.cuda_graph import PAD_SLOT, DecodeInputPacker
from kvstrata.engine.engine import Engine
from kvstrata.engine.runner import StepInputs

MAX_BS, MAX_PAGES = 8, 6


def decode_step(page_tables: list[list[int]]) -> StepInputs:
    """A decode step over `page_tables` (position = one token into each row's last page)."""
    positions = [4 * (len(pages) - 1) for pages in page_tables]
    return StepInputs(
        input_ids=[7] * len(page_tables),
        positions=positions,
        slots=[pages[-1] * 4 for pages in page_tables],
        query_lens=[1] * len(page_tables),
        kv_lens=[pos + 1 for pos in positions],
        page_tables=page_tables,
        sample_rows=list(range(len(page_tables))),
    )


def assert_rows(packer: DecodeInputPacker, page_tables: list[list[int]]) -> None:
    width = max(len(pages) for pages in page_tables)
    packed = packer.pack(decode_step(page_tables), MAX_BS)
    assert packed.page_table.shape == (len(page_tables), width)
    for row, pages in zip(packed.page_table.tolist(), page_tables):
        assert row[: len(pages)] == pages


def test_inputs_are_padded_to_the_batch_size() -> None:
    packer = DecodeInputPacker(MAX_BS, MAX_PAGES)
    packed = packer.pack(decode_step([[3], [5, 6]]), 4)
    assert packed.i64.tolist() == [[7, 7, 0, 0], [0, 4, 0, 0], [12, 24, PAD_SLOT, PAD_SLOT]]
    assert packed.seq_lens.tolist() == [1, 5, 0, 0]
    assert packed.page_table.tolist() == [[3, 0], [5, 6]]


def test_rows_follow_growth_departures_and_new_lists() -> None:
    packer = DecodeInputPacker(MAX_BS, MAX_PAGES)
    a, b, c = [1, 2], [3], [4, 5, 6]
    assert_rows(packer, [a, b, c])
    b.append(7)  # b grows a page in place
    assert_rows(packer, [a, b, c])
    assert_rows(packer, [a, c])  # b leaves: c moves up a row
    d = [8]  # a newcomer where c was
    assert_rows(packer, [c, a, d])
    a = [9, 10, 11]  # a preempted and readmitted: a new list (other pages)
    assert_rows(packer, [c, a, d])
    assert_rows(packer, [d])  # the batch shrinks; stale rows below stay unread
    assert_rows(packer, [d, c, b])  # c and b come back from stale rows


def test_a_copy_of_a_page_list_is_rewritten_every_step() -> None:
    packer = DecodeInputPacker(MAX_BS, MAX_PAGES)
    pages = [1, 2, 3]
    assert_rows(packer, [pages[:2]])
    assert_rows(packer, [[5, 6]])  # a fresh list with the same length, other pages


def test_random_batches_keep_every_row_exact() -> None:
    rng = random.Random(0)
    packer = DecodeInputPacker(MAX_BS, MAX_PAGES)
    next_page = iter(range(10_000))
    lists = [[next(next_page)] for _ in range(12)]
    for _ in range(300):
        for i in rng.sample(range(len(lists)), 4):
            if len(lists[i]) < MAX_PAGES and rng.random() < 0.5:
                lists[i].append(next(next_page))  # growth in place
            elif rng.random() < 0.2:
                lists[i] = [next(next_page) for _ in range(rng.randrange(1, MAX_PAGES))]
        batch = rng.sample(lists, rng.randrange(1, MAX_BS + 1))
        assert_rows(packer, batch)


def packed_engine(model: Path, overlap: str, **flags: object) -> tuple[Engine, list[int]]:
    """An engine whose every decode step is also packed and checked, row by row, against
    the page lists it was built from; returns it and the running count of checked steps."""
    eng = LLM(str(model), page_size=4, overlap_schedule=overlap, **flags).engine
    packer = DecodeInputPacker(16, 64)
    checked = [0]

    def checking(build):  # type: ignore[no-untyped-def]
        def build_and_check(*args):  # type: ignore[no-untyped-def]
            step = build(*args)
            if step.is_decode and step.num_seqs <= 16:
                packed = packer.pack(step, 16)
                for row, pages in zip(packed.page_table.tolist(), step.page_tables):
                    assert row[: len(pages)] == pages
                checked[0] += 1
            return step

        return build_and_check

    for name in ("build_step_inputs", "decode_step_inputs"):
        original = getattr(runner_module, name)
        setattr(runner_module, name, checking(original))
    return eng, checked


@pytest.fixture
def restore_runner_module():  # type: ignore[no-untyped-def]
    saved = {name: getattr(runner_module, name) for name in ("build_step_inputs",
                                                              "decode_step_inputs")}  # fmt: skip
    yield
    for name, fn in saved.items():
        setattr(runner_module, name, fn)


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.usefixtures("restore_runner_module")
def test_engine_decode_steps_with_preemption_and_aborts(tiny_llama: Path, overlap: str) -> None:
    # 30 pages of 4 tokens cannot hold all eight requests: some are preempted and
    # readmitted with new page lists; aborts and mixed lengths reshuffle the rows.
    eng, checked = packed_engine(tiny_llama, overlap, num_kv_pages=30)
    rng = random.Random(1)
    rids = []
    for i in range(8):
        prompt = [rng.randrange(500) for _ in range(rng.randrange(10, 30))]
        params = SamplingParams(max_tokens=10 + 3 * i, temperature=0.0, ignore_eos=True)
        rids.append(eng.add_request(prompt, params).rid)
    for step in range(500):
        eng.step()
        if step in (6, 11):
            eng.abort(rids[step % 8])
        if not eng.has_unfinished:
            break
    assert not eng.has_unfinished
    assert eng.scheduler.num_preemptions > 0
    assert checked[0] > 20
