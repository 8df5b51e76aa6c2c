"""When the router sends a request again, and after how long: which upstream failures are
retryable (the rank never produced an answer the client could have seen: refused, reset,
connect timeout, 502/503) and which end the request (an engine failure: the request may be
what broke the rank), the bounded attempts of one request and the ranks they tried, and
the exponential backoff with jitter between them."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from fastapi.responses import Response

from kvstrata.http.errors import OpenAIError

if TYPE_CHECKING:
    from kvstrata.config import RouterConfig

# A 4xx is the client's request (the next rank would refuse it too). A 500 is a bug the
# request met in the rank; sent on, the same request would likely meet it again, or
# take the next rank down with it. Ranks answer 503 while their engine cannot take work
# and 502 when a write into them failed: another rank may well serve the request.
RETRYABLE_STATUSES = frozenset({502, 503})
CAUSES = ("connect", "connect_timeout", "reset", "status_502", "status_503")
# A rank's stream opens before the request has run; a request that fails before its first
# token is one OpenAI-shaped error event, typed by status: then the stream is its 503.
_UNAVAILABLE_EVENT_TYPE = "service_unavailable_error"
# The error code of a rank whose engine failed in a step that held the request, with an
# error it could not pin on one request (the rank then exits): never retried.
ENGINE_FAILED = "engine_failed"


def cause_of_error(error: httpx.HTTPError) -> str | None:
    """The retry cause of a transport error, None if it is not retryable. A read timeout
    is not: the rank may still be working on the request."""
    if isinstance(error, httpx.ConnectTimeout):
        return "connect_timeout"
    if isinstance(error, httpx.ConnectError):
        return "connect"
    if isinstance(error, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return "reset"  # the connection broke before the rank's answer was complete
    return None


def died_holding_it(error: httpx.HTTPError) -> bool:
    """The connection broke after the whole request was sent and before the answer was
    complete: the rank died (or dropped it) holding the request. A refused connection, a
    connect timeout or a write that failed are not: the rank never held all of it."""
    return isinstance(error, (httpx.RemoteProtocolError, httpx.ReadError))


def error_of(content: bytes) -> dict[str, Any] | None:
    """The `error` object of an OpenAI error body, or of the first event of an SSE chunk
    (`data: {...}`); None if it holds none."""
    if b'"error"' not in content:
        return None
    if content.startswith(b"data: "):
        content = content[len(b"data: ") :].split(b"\n\n", 1)[0]
    try:
        body = json.loads(content)
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else None


def is_engine_failure(content: bytes) -> bool:
    """An OpenAI error body or SSE error event with the code `engine_failed`."""
    error = error_of(content)
    return error is not None and error.get("code") == ENGINE_FAILED


def cause_of_status(status_code: int) -> str | None:
    return f"status_{status_code}" if status_code in RETRYABLE_STATUSES else None


def cause_of_first_event(chunk: bytes) -> str | None:
    """The cause "status_503" if a stream's first chunk is a 503 error event, else None."""
    if not chunk.startswith(b"data: "):
        return None
    error = error_of(chunk)
    is_unavailable = error is not None and error.get("type") == _UNAVAILABLE_EVENT_TYPE
    return "status_503" if is_unavailable else None


@dataclass(frozen=True)
class Failure:
    """An attempt that failed before any byte reached the client, so it may be retried.
    `answer`: the rank's own answer (its 502/503), relayed if no attempt is left."""

    cause: str
    message: str
    answer: Response | None = None

    def final_answer(self) -> Response:
        if self.answer is not None:
            return self.answer
        raise OpenAIError(502, self.message, code="upstream_error")


@dataclass(frozen=True)
class RetryPolicy:
    """`max_attempts` in all (the first included; 1: no retries). Before retry k (k >= 1)
    the router waits min(base * multiplier^(k-1), max) scaled by a factor drawn uniformly
    from [1 - jitter, 1 + jitter]."""

    max_attempts: int
    backoff_base_s: float
    backoff_max_s: float
    backoff_multiplier: float
    jitter: float

    @classmethod
    def of(cls, config: RouterConfig) -> RetryPolicy:
        return cls(
            config.retry_max_attempts,
            config.retry_backoff_base_s,
            config.retry_backoff_max_s,
            config.retry_backoff_multiplier,
            config.retry_jitter,
        )

    def backoff_s(self, num_retries: int, rng: random.Random) -> float:
        """The wait before retry number `num_retries` (1 for the first retry)."""
        assert num_retries >= 1
        delay_s = self.backoff_base_s * self.backoff_multiplier ** (num_retries - 1)
        delay_s = min(delay_s, self.backoff_max_s)
        return delay_s * rng.uniform(1.0 - self.jitter, 1.0 + self.jitter)


@dataclass
class Attempts:
    """One request's attempts so far: the ranks they went to, which the next route
    avoids, the (decode, prefill) routes, none of which is tried twice, and what each
    failure was (for the answer when none is left)."""

    policy: RetryPolicy
    num_attempts: int = 0
    tried_urls: set[str] = field(default_factory=set)
    tried_routes: set[tuple[str, str | None]] = field(default_factory=set)
    last_cause: str | None = None
    failures: list[str] = field(default_factory=list)  # each failed attempt, in words

    def record(self, decode_url: str, prefill_url: str | None, failure: Failure) -> None:
        """An attempt on this route failed."""
        self.num_attempts += 1
        self.tried_urls.update(url for url in (decode_url, prefill_url) if url is not None)
        self.tried_routes.add((decode_url, prefill_url))
        self.last_cause = failure.cause
        self.failures.append(failure.message)

    @property
    def may_retry(self) -> bool:
        return self.num_attempts < self.policy.max_attempts
