"""The three workloads as conversations (chains of requests) built from synthetic tokens,
and a conversation's growing history rendered as token ids or as text.

Round r of a conversation sends, with answer k the server's output of round k:

    | turns[0] | answer 0 | turns[1] | answer 1 | ... | turns[r] |

multiturn: C conversations of R rounds (turns[0] = the first prompt, later turns = a
question each); shared-prefix: G x P one-round conversations whose turn is a group's system
prompt plus a question; trace: one-round conversations at the trace's arrival times."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from kvstrata.bench.config import BenchConfig
from kvstrata.bench.trace import TraceTokens, load_trace
from kvstrata.config import ConfigError

# Random-word text: 1,000 pronounceable words, a synthetic token t renders as WORDS[t % 1000].
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
WORDS: tuple[str, ...] = tuple(a + b for a in _SYLLABLES for b in _SYLLABLES)[:1000]

TextRenderer = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class Turn:
    """The new prompt tokens of one request (made when it is sent: trace prompts are
    large) and its output length."""

    make_tokens: Callable[[], list[int]]
    new_len: int
    max_tokens: int


@dataclass(frozen=True)
class Conversation:
    index: int
    group: int  # shared-prefix: the system prompt's group; else the conversation itself
    turns: tuple[Turn, ...]  # one per round
    arrival_s: float | None = None  # trace: start time after the run's start; else paced


@dataclass(frozen=True)
class Workload:
    name: str
    conversations: tuple[Conversation, ...]

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)


def _tokens(seed_words: list[int], length: int, vocab_size: int) -> Callable[[], list[int]]:
    ids = np.random.default_rng(seed_words).integers(0, vocab_size, size=length)
    return partial(ids.tolist)


def multiturn(config: BenchConfig, vocab_size: int) -> Workload:
    conversations = []
    for index in range(config.num_clients):
        turns = [
            Turn(
                _tokens([config.seed, 1, index, 0], config.first_prompt_len, vocab_size),
                config.first_prompt_len,
                config.output_len,
            )
        ]
        for r in range(1, config.num_rounds):
            question = _tokens([config.seed, 1, index, r], config.question_len, vocab_size)
            turns.append(Turn(question, config.question_len, config.output_len))
        conversations.append(Conversation(index, index, tuple(turns)))
    return Workload("multiturn", tuple(conversations))


def shared_prefix(config: BenchConfig, vocab_size: int) -> Workload:
    conversations: list[Conversation] = []
    for group in range(config.num_groups):
        system = np.random.default_rng([config.seed, 2, group]).integers(
            0, vocab_size, size=config.system_prompt_len
        )
        for p in range(config.prompts_per_group):
            question = np.random.default_rng([config.seed, 3, group, p]).integers(
                0, vocab_size, size=config.question_len
            )
            tokens = partial(np.concatenate([system, question]).tolist)
            length = config.system_prompt_len + config.question_len
            turn = Turn(tokens, length, config.output_len)
            conversations.append(Conversation(len(conversations), group, (turn,)))
    return Workload("shared-prefix", tuple(conversations))


def trace(config: BenchConfig, vocab_size: int, max_seq_len: int | None) -> Workload:
    """Trace records cut to fit: output capped by --max-output-len, prompt by
    --max-input-len and by the server's context (prompt + output < max_seq_len)."""
    records = load_trace(
        config.trace, config.trace_block_size, config.max_requests, config.trace_skip
    )
    tokens = TraceTokens(
        config.trace_block_size,
        config.trace_replay_block_size or config.trace_block_size,
        vocab_size,
        config.seed,
    )
    conversations = []
    start_ms = records[0].timestamp_ms if records else 0
    for index, record in enumerate(records):
        output_len = max(1, record.output_len)
        if config.max_output_len:
            output_len = min(output_len, config.max_output_len)
        max_len = config.max_input_len
        if max_seq_len is not None:
            output_len = min(output_len, max_seq_len // 2)  # leaves room for a prompt
            room = max_seq_len - 1 - output_len
            max_len = min(max_len, room) if max_len else room
        new_len = min(tokens.input_len(record), max_len) if max_len else tokens.input_len(record)
        turn = Turn(partial(tokens.prompt, record, max_len), new_len, output_len)
        arrival_s = (record.timestamp_ms - start_ms) / 1000.0 / config.trace_speed
        conversations.append(Conversation(index, index, (turn,), arrival_s))
    return Workload("trace", tuple(conversations))


def build_workload(config: BenchConfig, vocab_size: int, max_seq_len: int | None) -> Workload:
    """The configured workload, capped at --max-requests (whole conversations first).
    Raises ConfigError if a multiturn or shared-prefix request cannot fit the context."""
    if config.workload == "trace":
        return trace(config, vocab_size, max_seq_len)
    workload = (
        multiturn(config, vocab_size)
        if config.workload == "multiturn"
        else (shared_prefix(config, vocab_size))
    )
    longest = longest_prompt_len(workload)
    if max_seq_len is not None and longest + config.output_len >= max_seq_len:
        sizes = (
            "--first-prompt-len + (--num-rounds - 1) x (--question-len + --output-len)"
            if config.workload == "multiturn"
            else "--system-prompt-len + --question-len"
        )
        raise ConfigError(
            f"the longest prompt ({longest} tokens) plus --output-len {config.output_len} does "
            f"not fit the server's context of {max_seq_len} tokens; the longest prompt is "
            f"{sizes}: shrink them"
        )
    return cap_requests(workload, config.max_requests)


def longest_prompt_len(workload: Workload) -> int:
    """The longest prompt a conversation sends (its last round), in tokens."""
    return max(
        (
            sum(t.new_len for t in c.turns) + sum(t.max_tokens for t in c.turns[:-1])
            for c in workload.conversations
        ),
        default=0,
    )


def cap_requests(workload: Workload, max_requests: int) -> Workload:
    if not max_requests or workload.num_requests <= max_requests:
        return workload
    kept: list[Conversation] = []
    left = max_requests
    for conversation in workload.conversations:
        if left == 0:
            break
        turns = conversation.turns[:left]
        kept.append(
            Conversation(conversation.index, conversation.group, turns, conversation.arrival_s)
        )
        left -= len(turns)
    return Workload(workload.name, tuple(kept))


def words_text(token_ids: Sequence[int]) -> str:
    return "".join(WORDS[t % len(WORDS)] + " " for t in token_ids)


class History:
    """What a conversation has said so far, as the next prompt. Token mode keeps ids (the
    answers' output ids); text mode keeps text (turns rendered by `render`, answers as the
    server wrote them), so each prompt extends the previous one in either mode."""

    def __init__(self, render: TextRenderer | None) -> None:
        self.render = render
        self.token_ids: list[int] = []
        self.parts: list[str] = []
        self.num_tokens = 0  # token mode: exact; text mode: synthetic + answer tokens

    def add_turn(self, token_ids: list[int]) -> None:
        self.num_tokens += len(token_ids)
        if self.render is None:
            self.token_ids.extend(token_ids)
        else:
            self.parts.append(self.render(token_ids))

    def add_answer(self, output_ids: Sequence[int], text: str, num_tokens: int) -> None:
        self.num_tokens += num_tokens
        if self.render is None:
            self.token_ids.extend(output_ids)
        else:
            self.parts.append(text)

    def prompt(self) -> list[int] | str:
        return list(self.token_ids) if self.render is None else "".join(self.parts)

    def copy(self) -> History:
        """A sub-agent's history: everything the parent has said so far."""
        other = History(self.render)
        other.token_ids = list(self.token_ids)
        other.parts = list(self.parts)
        other.num_tokens = self.num_tokens
        return other
