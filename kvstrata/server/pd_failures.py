"""What a decode rank does when a room fails (`--disaggregation-kv-failure-policy`): the
failure's cause, the next path to try (another prefill rank, then this rank's own
prefill) and the counts by cause and outcome for /metrics."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from kvstrata.disagg.transport.base import TransferError

CAUSES = ("unreachable", "timeout", "prefill_error", "transfer", "mismatch")
OUTCOMES = ("retried", "recomputed", "failed")


class PrefillRankError(TransferError):
    """A prefill rank answered a room with an error status."""

    def __init__(self, url: str, status_code: int, text: str) -> None:
        super().__init__(f"prefill rank {url} answered {status_code}: {text[:200]}")
        self.status_code = status_code


def failure_cause(error: BaseException) -> str:
    """One of CAUSES. A 502 from /pd/prefill is its write into this rank failing."""
    if isinstance(error, httpx.TimeoutException) and not isinstance(error, httpx.ConnectTimeout):
        return "timeout"
    if isinstance(error, httpx.HTTPError):
        return "unreachable"  # refused, reset, or closed mid-answer: the rank is gone
    if isinstance(error, PrefillRankError):
        return "transfer" if error.status_code == 502 else "prefill_error"
    return "mismatch"  # a result that is not one, or does not match its room


@dataclass
class Attempts:
    """The rooms one request tried so far, as 'url (why)'."""

    urls: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """Each attempt's reason, naming its prefill rank where the reason does not."""
        return "; then ".join(
            why if url in why else f"{why} (prefill rank {url})"
            for url, why in zip(self.urls, self.reasons)
        )


class FailurePolicy:
    """`retry`: a new room on a prefill rank of `fallback_urls` the request has not tried,
    then local prefill; `recompute`: local prefill at once; `fail`: no second path."""

    def __init__(self, mode: str, fallback_urls: Sequence[str]) -> None:
        self.mode = mode
        self.fallback_urls = tuple(fallback_urls)
        self.counts: Counter[tuple[str, str]] = Counter()

    def next_url(self, attempts: Attempts) -> str | None:
        if self.mode != "retry":
            return None
        return next((url for url in self.fallback_urls if url not in attempts.urls), None)

    @property
    def may_recompute(self) -> bool:
        return self.mode != "fail"

    def give_up_message(self, attempts: Attempts) -> str:
        """Why a request fails: every prefill rank it tried. (With `retry` or `recompute`
        it fails only if it also could not be prefilled here, i.e. it is gone already.)"""
        return f"prefill for this request failed: {attempts.summary()}"

    def count(self, cause: str, outcome: str) -> None:
        self.counts[(cause, outcome)] += 1
