"""Token sampling (the draws themselves: engine/draw.py). A seeded request's draw for output
token i comes from a generator seeded with (seed, i) alone, so the same seed gives the same
tokens whatever batch it rides in and whichever process (unified, prefill, decode) samples.
One seam (`_sample_adjusted`), taken only by a batch holding a request that is not plain,
adds logits adjustments (engine/penalties.py) and logprobs (engine/logprobs.py); prompt
logprobs (echo) are recorded from the prompt rows the runner hands over. A row that cannot
be sampled fails its own request only (`Sampled.failures`), never the batch."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvstrata.core import Request
from kvstrata.engine.draw import Draws, draw
from kvstrata.engine.grammar import GrammarBook
from kvstrata.engine.logprobs import token_logprobs
from kvstrata.engine.penalties import LogitsAdjuster

if TYPE_CHECKING:
    from kvstrata.engine.runner import PromptRows

_PROMPT_ROWS_PER_PASS = 256


_NO_MASS = "sampling failed: no token has a finite, positive probability"


class RowFailure(NamedTuple):
    request: Request
    message: str


class Sampled(NamedTuple):
    """A batch's draws: `token_ids[k]` is the token of `requests[k]`; the rows whose
    sampling raised are in `failures` instead (nearly always empty)."""

    requests: list[Request]
    token_ids: list[int]
    failures: list[RowFailure]


class Sampler:
    def __init__(
        self,
        default_seed: int,
        eos_token_ids: Sequence[int] = (),
        grammars: GrammarBook | None = None,
    ) -> None:
        self.default_seed = default_seed
        self.adjuster = LogitsAdjuster(eos_token_ids)
        # Constrained requests' matchers (their mask joins the seam below); None: an engine
        # without structured output (a sampler made on its own, in tests).
        self.grammars = grammars if grammars is not None else GrammarBook(None)
        # Live requests that are not plain, registered by `track`: while there are none, a
        # batch takes the plain path on one check (no per-request look).
        self._adjusted: set[str] = set()
        # Unseeded requests share one stream per device (reproducible per engine run only).
        self._shared: dict[torch.device, torch.Generator] = {}
        # Seeded draws reuse one generator per device, reseeded before every draw: its
        # state never carries from one draw to the next, so it holds no per-request state.
        self._reseeded: dict[torch.device, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> Sampled:
        """One token per row of `logits` ([num_requests, vocab], float32). Row k samples
        output token `requests[k].num_output_tokens` of its request (not yet appended).
        A request with `params.logprobs` set gets the token's logprobs appended to its
        `output_logprobs` here. Requests that are not plain must have been `track`ed.

        If the batch raises, each row is sampled alone, so one request's parameters fail
        that request only. Seeded draws are the same either way (each reseeds)."""
        try:
            return self._sample_batch(logits, requests)
        except Exception:
            return self._sample_rows(logits, requests)

    def _sample_batch(self, logits: torch.Tensor, requests: list[Request]) -> Sampled:
        if self._adjusted and not all(req.params.is_plain for req in requests):
            draws = self._sample_adjusted(logits, requests)
        else:
            draws = draw(logits, requests, self._generator)
        if not draws.invalid_rows:
            return Sampled(requests, draws.token_ids, [])
        invalid = set(draws.invalid_rows)
        kept = [k for k in range(len(requests)) if k not in invalid]
        failures = [RowFailure(requests[k], _NO_MASS) for k in draws.invalid_rows]
        return Sampled([requests[k] for k in kept], [draws.token_ids[k] for k in kept], failures)

    def _sample_rows(self, logits: torch.Tensor, requests: list[Request]) -> Sampled:
        sampled = Sampled([], [], [])
        for k, req in enumerate(requests):
            try:
                alone = self._sample_batch(logits[k : k + 1], [req])
            except Exception as e:
                sampled.failures.append(RowFailure(req, f"sampling failed: {e}"))
                continue
            sampled.requests.extend(alone.requests)
            sampled.token_ids.extend(alone.token_ids)
            sampled.failures.extend(alone.failures)
        return sampled

    def track(self, req: Request) -> None:
        """A new request (until `release`): one that is not plain makes batches check; a
        constrained one gets its grammar matcher (raises GrammarError, tracking nothing)."""
        self.grammars.track(req)
        if not req.params.is_plain:
            self._adjusted.add(req.rid)

    @property
    def num_adjusted(self) -> int:
        """Live requests that are not plain."""
        return len(self._adjusted)

    def record_prompt_logprobs(
        self, prompt_rows: list[PromptRows], logits_of: Callable[[torch.Tensor], torch.Tensor]
    ) -> list[RowFailure]:
        """Append each row's logprob of the next prompt token to its request's
        `prompt_logprobs`, `_PROMPT_ROWS_PER_PASS` rows of logits at a time (a long prompt
        chunk's logits would not fit in memory at once). A request whose logprobs raise
        (e.g. out of device memory) is returned as failed; the others are recorded."""
        failures = []
        for rows in prompt_rows:
            try:
                self._record_prompt_rows(rows, logits_of)
            except Exception as e:
                failures.append(RowFailure(rows.request, f"prompt logprobs failed: {e}"))
        return failures

    def _record_prompt_rows(
        self, rows: PromptRows, logits_of: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        req = rows.request
        num_top = req.params.prompt_logprobs or 0
        for start in range(0, rows.hidden.shape[0], _PROMPT_ROWS_PER_PASS):
            hidden = rows.hidden[start : start + _PROMPT_ROWS_PER_PASS]
            first = rows.first_pos + start + 1  # the token row `start` predicts
            targets = req.prompt_ids[first : first + hidden.shape[0]]
            req.prompt_logprobs += token_logprobs(
                logits_of(hidden), targets, [num_top] * len(targets)
            )

    def release(self, rid: str) -> None:
        """The request ended: drop its token counts."""
        self._adjusted.discard(rid)
        self.adjuster.release(rid)
        self.grammars.release(rid)

    def _sample_adjusted(self, logits: torch.Tensor, requests: list[Request]) -> Draws:
        """The seam: adjust the rows that ask for it, mask what their grammars forbid,
        draw, then record logprobs (of the raw logits, as vLLM reports by default; for a
        constrained row, of the raw logits masked by its grammar) of the rows that drew a
        token."""
        rows = [k for k, req in enumerate(requests) if not req.params.is_plain]
        index = torch.tensor(rows, dtype=torch.long).to(logits.device)
        adjusted = logits.clone()
        adjusted[index] = self.adjuster.apply(logits[index], [requests[k] for k in rows])
        if self.grammars.num_tracked:
            logits = logits.clone()  # the caller's logits stay as the model made them
            self.grammars.mask(requests, adjusted, logits)
        draws = draw(adjusted, requests, self._generator)
        token_ids, invalid = draws.token_ids, set(draws.invalid_rows)
        wanting = [k for k in rows if requests[k].params.logprobs is not None and k not in invalid]
        if wanting:
            records = token_logprobs(
                logits[torch.tensor(wanting, dtype=torch.long).to(logits.device)],
                [token_ids[k] for k in wanting],
                [requests[k].params.logprobs or 0 for k in wanting],
            )
            for k, record in zip(wanting, records):
                requests[k].output_logprobs.append(record)
        return draws

    def _generator(self, req: Request, device: torch.device) -> torch.Generator:
        if req.params.seed is None:
            if device not in self._shared:
                self._shared[device] = _seeded(self.default_seed, device)
            return self._shared[device]
        if device not in self._reseeded:
            self._reseeded[device] = torch.Generator(device=device)
        gen = self._reseeded[device]
        gen.manual_seed(draw_seed(req.params.seed, req.num_output_tokens))
        return gen


def draw_seed(seed: int, token_index: int) -> int:
    """The generator seed of output token `token_index` of a request seeded `seed`: a hash,
    so nearby (seed, index) pairs give unrelated streams. Any Python int seed is accepted
    (negative or wider than 64 bits); the result fits torch's 64-bit seed."""
    key = f"{seed}".encode() + struct.pack("<Q", token_index)
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def _seeded(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
