"""The bench runner against a fake backend: multi-turn prompts extend the previous prompt
by the answer and a question, the round barrier orders rounds, a failed request ends its
conversation, the concurrency cap holds, and the time bound ends a stuck run."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import pytest

from kvstrata.bench.client import Completion
from kvstrata.bench.config import BenchConfig
from kvstrata.bench.runner import Pacing, RunOutcome, run_workload
from kvstrata.bench.workloads import Workload, build_workload, words_text
from kvstrata.config import ConfigError

VOCAB = 500


def completion(output_ids: list[int], ok: bool = True) -> Completion:
    return Completion(
        ok=ok,
        error=None if ok else "boom",
        ttft_s=0.01,
        e2e_s=0.02,
        itl_s=(),
        output_ids=tuple(output_ids),
        text="answer ",
        num_output_tokens=len(output_ids),
        num_prompt_tokens=None,
        cached_tokens=None,
        tiers=None,
        rank=0,
    )


class FakeBackend:
    """Answers each prompt with `answer(prompt)` after `gate(call)` lets it through."""

    def __init__(self, answer: Callable[[list[int] | str], Completion]) -> None:
        self.answer = answer
        self.prompts: list[list[int] | str] = []
        self.events: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.release: asyncio.Event | None = None

    async def send(self, prompt: list[int] | str, max_tokens: int) -> Completion:
        self.prompts.append(prompt)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.events.append(f"start {len(self.prompts) - 1}")
        for _ in range(len(self.prompts) % 3):  # uneven completion order
            await asyncio.sleep(0)
        if self.release is not None:
            await self.release.wait()
        self.in_flight -= 1
        return self.answer(prompt)


def multiturn(num_clients: int = 3, num_rounds: int = 3) -> Workload:
    config = BenchConfig(
        num_clients=num_clients,
        num_rounds=num_rounds,
        first_prompt_len=5,
        question_len=2,
        output_len=3,
    )
    return build_workload(config, VOCAB, max_seq_len=None)


def run(
    workload: Workload,
    backend: FakeBackend,
    barrier: bool = False,
    cap: int = 0,
    text: bool = False,
    max_duration_s: float = 30.0,
) -> RunOutcome:
    pacing = Pacing(0.0, "poisson", cap, barrier, seed=0)
    render = words_text if text else None
    return asyncio.run(run_workload(workload, backend, pacing, render, max_duration_s))  # type: ignore[arg-type]


def test_each_round_extends_the_previous_prompt_by_answer_and_question() -> None:
    workload = multiturn()
    backend = FakeBackend(lambda prompt: completion([len(prompt), 7, 7]))
    outcome = run(workload, backend)
    assert len(outcome.results) == 9 and not outcome.timed_out
    for conversation in workload.conversations:
        mine = sorted(
            (r for r in outcome.results if r.conversation == conversation.index),
            key=lambda r: r.round,
        )
        expected: list[int] = []
        for result, turn in zip(mine, conversation.turns):
            expected = expected + turn.make_tokens()
            assert result.prompt_tokens == len(expected)
            assert list(result.completion.output_ids) == [len(expected), 7, 7]
            expected += list(result.completion.output_ids)
    assert sorted(len(p) for p in backend.prompts) == [5] * 3 + [10] * 3 + [15] * 3


def test_text_mode_prompts_extend_too() -> None:
    backend = FakeBackend(lambda prompt: completion([1, 2, 3]))
    run(multiturn(num_clients=1), backend, text=True)
    first, second, third = backend.prompts
    assert isinstance(first, str) and second.startswith(first + "answer ")
    assert third.startswith(second + "answer ")


def test_round_barrier_sends_round_r_plus_1_after_every_round_r() -> None:
    backend = FakeBackend(lambda prompt: completion([1, 2, 3]))
    outcome = run(multiturn(num_clients=4), backend, barrier=True, cap=2)
    starts = [r.round for r in sorted(outcome.results, key=lambda r: r.start_s)]
    assert starts == sorted(starts)
    assert backend.max_in_flight <= 2


def test_a_failed_request_ends_its_conversation_and_the_run_still_ends() -> None:
    workload = multiturn(num_clients=3, num_rounds=3)
    first = workload.conversations[1].turns[0].make_tokens()

    def answer(prompt: list[int] | str) -> Completion:
        # Conversation 1's second round fails.
        return completion([1, 2, 3], ok=not (prompt[:5] == first and len(prompt) == 10))

    for barrier in (False, True):
        outcome = run(workload, FakeBackend(answer), barrier=barrier)
        assert [(r.conversation, r.round) for r in outcome.results if not r.completion.ok] == [
            (1, 1)
        ]
        assert sorted(r.round for r in outcome.results if r.conversation == 1) == [0, 1]
        assert len(outcome.results) == 8 and not outcome.timed_out


def test_the_time_bound_ends_a_run_whose_requests_never_finish() -> None:
    backend = FakeBackend(lambda prompt: completion([1]))
    backend.release = asyncio.Event()  # never set: every request hangs
    outcome = run(multiturn(), backend, max_duration_s=0.2)
    assert outcome.timed_out and outcome.results == []


def test_a_workload_past_the_context_is_refused_naming_the_flags() -> None:
    # The README's old sizes against the tiny model: 1024 + 5 x (256 + 64) = 2624 tokens.
    config = BenchConfig(num_clients=1, num_rounds=6, first_prompt_len=1024, question_len=256)
    with pytest.raises(ConfigError, match=r"\(2624 tokens\).* context of 2048 tokens") as e:
        build_workload(config, VOCAB, max_seq_len=2048)
    assert "--first-prompt-len + (--num-rounds - 1) x (--question-len + --output-len)" in str(
        e.value
    )
    fits = dataclasses.replace(config, num_rounds=3, first_prompt_len=256, question_len=64)
    assert build_workload(fits, VOCAB, max_seq_len=2048).num_requests == 3
