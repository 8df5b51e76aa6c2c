"""How token logprobs read in each API: chat's `logprobs.content` entries (token, logprob,
bytes, top_logprobs), the completions legacy shape (tokens, token_logprobs, top_logprobs,
text_offset) and /generate's token-id lists; the text of each token, decoded once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstrata.core import RequestOutput, TokenLogprobs
from kvstrata.http.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    GenerateLogprob,
    GenerateTopLogprob,
)

if TYPE_CHECKING:
    from kvstrata.model.tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0  # vLLM's stand-in for -inf: JSON has no infinities


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class TokenTexts:
    """One token's text, as the API shows it: decoded alone, special tokens included; a
    model without a tokenizer shows `token_id:<id>` (vLLM's return_tokens_as_token_ids)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text


def new_records(out: RequestOutput, num_new_tokens: int) -> list[TokenLogprobs] | None:
    """The logprobs of the last `num_new_tokens` output tokens (a stream's delta); None
    when the request records none or there are no new tokens."""
    if out.logprobs is None or num_new_tokens == 0:
        return None
    return out.logprobs[len(out.output_ids) - num_new_tokens :]


def chat_logprobs(records: Sequence[TokenLogprobs], texts: TokenTexts) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> ChatTopLogprob:
        text = texts(token_id)
        return ChatTopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode()))

    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                **top(r.token_id, r.logprob).model_dump(),
                top_logprobs=[top(t, lp) for t, lp in r.top],
            )
            for r in records
        ]
    )


def completion_logprobs(
    records: Sequence[TokenLogprobs | None],
    token_ids: Sequence[int],
    texts: TokenTexts,
    text_offset: int,
) -> CompletionLogprobs:
    """`records[i]` belongs to `token_ids[i]` (None: no logprob, the first prompt token of
    an echo); offsets count characters from `text_offset` (the prompt's length on echo)."""
    tokens = [texts(t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(text_offset)
        text_offset += len(text)
    top_logprobs: list[dict[str, float] | None] = []
    for record in records:
        if record is None:
            top_logprobs.append(None)
            continue
        # The legacy API always lists the chosen token too: up to logprobs + 1 entries.
        entries = {texts(t): _finite(lp) for t, lp in record.top}
        entries.setdefault(texts(record.token_id), _finite(record.logprob))
        top_logprobs.append(entries)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if r is None else _finite(r.logprob) for r in records],
        top_logprobs=top_logprobs,
        text_offset=offsets,
    )


@dataclass(frozen=True)
class CompletionShape:
    """What a completion choice shows besides its output text: the echoed prompt
    (`echoes[i]` for prompt i, choice i * n + j; None without echo) and the logprobs in the
    legacy shape, led on echo with logprobs by the prompt tokens' (the first one null)."""

    n: int
    echoes: list[str] | None
    texts: TokenTexts
    echo_logprobs: bool = False

    def echo(self, index: int) -> str:
        return "" if self.echoes is None else self.echoes[index // self.n]

    def logprobs(
        self,
        index: int,
        out: RequestOutput,
        token_ids: list[int],
        text_offset: int,
        first: bool,
    ) -> CompletionLogprobs | None:
        """Of `token_ids`, the newest output tokens, whose texts start `text_offset`
        characters into the output (counted in token texts); `first`: the choice's first
        logprobs, which carry the prompt's."""
        records = new_records(out, len(token_ids)) or []
        if first and self.echo_logprobs and out.prompt_logprobs is not None:
            prompt_records: list[TokenLogprobs | None] = [None, *out.prompt_logprobs]
            return completion_logprobs(
                [*prompt_records, *records], out.prompt_ids + token_ids, self.texts, 0
            )
        if not records:
            return None
        return completion_logprobs(
            records, token_ids, self.texts, self._output_offset(index, out) + text_offset
        )

    def _output_offset(self, index: int, out: RequestOutput) -> int:
        """Where the output text starts: after the echo, which with logprobs is counted
        in its tokens' texts (as the offsets of its tokens are)."""
        if self.echo_logprobs:
            return sum(len(self.texts(t)) for t in out.prompt_ids)
        return len(self.echo(index))


def generate_logprobs(records: Sequence[TokenLogprobs]) -> list[GenerateLogprob]:
    return [
        GenerateLogprob(
            token_id=r.token_id,
            logprob=_finite(r.logprob),
            top_logprobs=[GenerateTopLogprob(token_id=t, logprob=_finite(lp)) for t, lp in r.top],
        )
        for r in records
    ]
