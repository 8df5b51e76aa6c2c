"""What a decode rank does when a room fails (`--disaggregation-kv-failure-policy`): the
failure's cause, the next path to try (another prefill rank, then this rank's own
prefill) from the request's attempt history (`Attempts`, which its rooms carry) and the
counts by cause and outcome for /metrics."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import httpx

from kvstrata.disagg.rooms import Attempts
from kvstrata.disagg.transport.base import TransferError

CAUSES = (
    "unreachable",
    "unresponsive",
    "timeout",
    "prefill_error",
    "request_error",
    "transfer",
    "mismatch",
)
OUTCOMES = ("retried", "recomputed", "failed")
# Error codes of a prefill rank's answer that the request itself caused there: sent on to
# another rank, or computed here, it would fail (or take this rank down) the same way.
REQUEST_ERROR_CODES = frozenset({"request_failed", "engine_failed"})


class PrefillRankError(TransferError):
    """A prefill rank answered a room with an error status (and error `code`, if any)."""

    def __init__(self, url: str, status_code: int, text: str, code: str | None = None) -> None:
        super().__init__(f"prefill rank {url} answered {status_code}: {text[:200]}")
        self.status_code = status_code
        self.code = code


class PrefillUnresponsive(TransferError):
    """The prefill rank a room waits on stopped answering (decode_watch.py)."""


def failure_cause(error: BaseException) -> str:
    """One of CAUSES. A 502 from /pd/prefill is its write into this rank failing."""
    if isinstance(error, httpx.TimeoutException) and not isinstance(error, httpx.ConnectTimeout):
        return "timeout"
    if isinstance(error, httpx.HTTPError):
        return "unreachable"  # refused, reset, or closed mid-answer: the rank is gone
    if isinstance(error, PrefillUnresponsive):
        return "unresponsive"
    if isinstance(error, PrefillRankError):
        if error.code in REQUEST_ERROR_CODES:
            return "request_error"
        return "transfer" if error.status_code == 502 else "prefill_error"
    return "mismatch"  # a result that is not one, or does not match its room


class FailurePolicy:
    """`retry`: a new room on a prefill rank of `fallback_urls` the request has not tried,
    then local prefill; `recompute`: local prefill at once; `fail`: no second path."""

    def __init__(self, mode: str, fallback_urls: Sequence[str]) -> None:
        self.mode = mode
        self.fallback_urls = tuple(fallback_urls)
        self.counts: Counter[tuple[str, str]] = Counter()

    def next_url(self, attempts: Attempts, cause: str) -> str | None:
        if self.mode != "retry" or cause == "request_error":
            return None
        return next((url for url in self.fallback_urls if url not in attempts.urls), None)

    @property
    def allows_local(self) -> bool:
        """Whether this rank may prefill a request itself when no prefill rank can."""
        return self.mode != "fail"

    def may_recompute(self, cause: str) -> bool:
        return self.allows_local and cause != "request_error"

    def give_up_message(self, attempts: Attempts) -> str:
        """Why a request fails: every prefill rank it tried. (With `retry` or `recompute`
        it fails only if it also could not be prefilled here, i.e. it is gone already.)"""
        return f"prefill for this request failed: {attempts.summary()}"

    def count(self, cause: str, outcome: str) -> None:
        self.counts[(cause, outcome)] += 1
