"""A steady, bounded multi-turn load for the fault tests, and its judge. Conversations run
on client threads; each turn is a greedy /generate (streamed or not) of the history plus
new user tokens. Every request must end completed with exactly the unified reference's
tokens, or failed with a clear OpenAI-style error; nothing else is allowed."""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvstrata import LLM, SamplingParams

MAX_NEW_TOKENS = 6
PAGE_SIZE = 4  # of every fault cluster and of the reference
ERROR_FIELDS = {"message", "type", "param", "code"}


@dataclass
class Outcome:
    """How one request ended. kind: completed | failed (a clear error) | unexpected (an
    answer that is neither) | transport (no HTTP answer: connection refused or cut)."""

    prompt: list[int]
    max_new_tokens: int
    stream: bool
    kind: str
    output_ids: list[int] = field(default_factory=list)
    detail: str = ""
    usage: dict[str, Any] | None = None

    @property
    def rank(self) -> int | None:
        return None if self.usage is None else self.usage["kvstrata"]["rank"]

    def complete(self, output_ids: list[int], usage: dict[str, Any]) -> None:
        self.kind, self.output_ids, self.usage = "completed", output_ids, usage


def generate(
    client: httpx.Client, prompt: list[int], stream: bool, max_new_tokens: int = MAX_NEW_TOKENS
) -> Outcome:
    """One greedy /generate, classified."""
    body = {
        "input_ids": prompt, "stream": stream,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                            "ignore_eos": True},
    }  # fmt: skip
    outcome = Outcome(prompt, max_new_tokens, stream, "unexpected")
    try:
        with client.stream("POST", "/generate", json=body) as response:
            if not stream or response.status_code != 200:
                response.read()
                _judge_json(response, outcome)
            else:
                _judge_events(response, outcome)
    except httpx.TransportError as e:
        outcome.kind, outcome.detail = "transport", f"{type(e).__name__}: {e}"
    return outcome


def _judge_json(response: httpx.Response, outcome: Outcome) -> None:
    try:
        body = response.json()
    except ValueError:
        outcome.detail = f"{response.status_code}, not JSON: {response.text[:200]}"
        return
    if response.status_code == 200 and body.get("finish_reason") == "length":
        outcome.complete(body["output_ids"], body["usage"])
    elif response.status_code >= 400 and set(body.get("error", {})) == ERROR_FIELDS:
        outcome.kind, outcome.detail = "failed", f"{response.status_code}: {body['error']}"
    else:
        outcome.detail = f"{response.status_code}: {response.text[:300]}"


def _judge_events(response: httpx.Response, outcome: Outcome) -> None:
    events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        outcome.detail = f"the stream ended without [DONE] after {len(events)} events"
        return
    output_ids: list[int] = []
    for event in map(json.loads, events[:-1]):
        if "error" in event:
            if set(event["error"]) == ERROR_FIELDS:
                outcome.kind, outcome.detail = "failed", f"stream error: {event['error']}"
            else:
                outcome.detail = f"malformed error event: {event}"
            return
        output_ids += event["output_ids"]
        if event["finish_reason"] is not None:
            if event["finish_reason"] != "length":
                outcome.detail = f"finished by {event['finish_reason']}"
                return
            outcome.complete(output_ids, event["usage"])
    if outcome.kind != "completed" and not outcome.detail:
        outcome.detail = "the stream ended without a finish reason"


class Load:
    """`num_conversations` conversations through `url`, until `stop()` or `max_turns`
    turns each (bounded). Each turn appends the last answer and 5-20 new tokens; a
    conversation that outgrows `max_prompt_len` starts over. A failed turn is retried
    with new tokens appended, as a user would."""

    def __init__(
        self, url: str, num_conversations: int, seed: int, max_prompt_len: int = 160,
        max_turns: int = 40, headers: dict[str, str] | None = None,
        max_new_tokens: int = MAX_NEW_TOKENS,
    ) -> None:  # fmt: skip
        self.url = url
        self.max_prompt_len = max_prompt_len
        self.max_turns = max_turns
        self.headers = headers or {}
        self.max_new_tokens = max_new_tokens
        self.outcomes: list[Outcome] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._converse, args=(seed * 1000 + i,), daemon=True)
            for i in range(num_conversations)
        ]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def num_done(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def count(self, kind: str) -> int:
        with self._lock:
            return sum(outcome.kind == kind for outcome in self.outcomes)

    def stop(self, timeout_s: float = 180.0) -> list[Outcome]:
        """Let each conversation finish its current turn, then return every outcome."""
        self.request_stop()
        return self.join(timeout_s)

    def request_stop(self) -> None:
        """No conversation starts another turn (without waiting for the current ones)."""
        self._stopping.set()

    def join(self, timeout_s: float = 180.0) -> list[Outcome]:
        """Wait (bounded) until every conversation has ended; return every outcome."""
        for thread in self._threads:
            thread.join(timeout_s)
            assert not thread.is_alive(), "a client is stuck in a request"
        with self._lock:
            return list(self.outcomes)

    def _converse(self, seed: int) -> None:
        rng = random.Random(seed)
        history: list[int] = []
        with httpx.Client(base_url=self.url, timeout=120, headers=self.headers) as client:
            for turn in range(self.max_turns):
                if self._stopping.is_set():
                    return
                new_tokens = [rng.randrange(500) for _ in range(rng.randrange(5, 21))]
                if len(history) + len(new_tokens) > self.max_prompt_len:
                    history = []
                prompt = history + new_tokens
                outcome = generate(client, prompt, stream=turn % 2 == 1,
                                   max_new_tokens=self.max_new_tokens)  # fmt: skip
                with self._lock:
                    self.outcomes.append(outcome)
                history = prompt + outcome.output_ids if outcome.kind == "completed" else prompt


class Reference:
    """Unified greedy outputs (the correctness oracle), computed in batches and cached."""

    def __init__(self, model: str, page_size: int) -> None:
        self.llm = LLM(model, page_size=page_size, disable_radix_cache=True, num_kv_pages=8192)
        self._outputs: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def outputs(self, requests: Sequence[tuple[list[int], int]]) -> list[list[int]]:
        """The reference output of each (prompt, max_new_tokens)."""
        todo = sorted({(tuple(p), n) for p, n in requests} - set(self._outputs))
        for max_new in sorted({n for _, n in todo}):
            prompts = [list(p) for p, n in todo if n == max_new]
            params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
            for start in range(0, len(prompts), 64):
                batch = prompts[start : start + 64]
                outs = self.llm.generate(input_ids=batch, sampling_params=params)
                for prompt, out in zip(batch, outs):
                    self._outputs[(tuple(prompt), max_new)] = out.output_ids
        return [self._outputs[(tuple(p), n)] for p, n in requests]


def judge(
    outcomes: Sequence[Outcome], reference: Reference, allow_transport: bool = False
) -> Counter[str]:
    """Assert every outcome is allowed; returns the count of each kind."""
    kinds = Counter(outcome.kind for outcome in outcomes)
    bad = [o for o in outcomes if o.kind == "unexpected"]
    assert not bad, f"{len(bad)} unexpected answers, e.g. {bad[0].detail}"
    if not allow_transport:
        cut = [o for o in outcomes if o.kind == "transport"]
        assert not cut, f"{len(cut)} requests got no answer, e.g. {cut[0].detail}"
    done = [o for o in outcomes if o.kind == "completed"]
    expected = reference.outputs([(o.prompt, o.max_new_tokens) for o in done])
    wrong = [o for o, want in zip(done, expected) if o.output_ids != want]
    assert not wrong, (
        f"{len(wrong)} of {len(done)} completed requests differ from the unified reference, "
        f"e.g. prompt of {len(wrong[0].prompt)} tokens ({'stream' if wrong[0].stream else 'json'})"
        f": {wrong[0].output_ids} (usage {wrong[0].usage})"
    )
    return kinds


def serves_correctly(url: str, reference: Reference, seed: int = 99) -> None:
    """After a fault: a short clean conversation load completes, every answer exact."""
    with Load(url, num_conversations=2, seed=seed, max_turns=3) as load:
        outcomes = load.join()
    kinds = judge(outcomes, reference)
    assert kinds["completed"] == len(outcomes) == 6, [o.detail for o in outcomes]
