"""Circuit breakers of the router, one per rank URL, owned by one `CircuitBreakers`: which
ranks a request may be sent to now, the one probe an open breaker lets through after its
cool-down, and the transitions, for /metrics. Only forwards count; polls do not."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.config import RouterConfig


class BreakerState(enum.Enum):
    CLOSED = "closed"  # traffic flows; consecutive failures are counted
    OPEN = "open"  # no traffic until the cool-down has passed
    HALF_OPEN = "half_open"  # one probe request is out; its outcome decides


@dataclass(frozen=True)
class Transition:
    url: str
    old: BreakerState
    new: BreakerState


@dataclass(frozen=True)
class Ticket:
    """What sending one request to `url` was, for the breaker: `probe` is True for the
    one request a half-open breaker let through (only its outcome moves the breaker)."""

    url: str
    probe: bool


@dataclass
class _Breaker:
    state: BreakerState = BreakerState.CLOSED
    num_consecutive_failures: int = 0
    opened_at_s: float = 0.0
    probe_out: bool = False  # half-open: the probe is in flight


class CircuitBreakers:
    """closed --`failure_threshold` failures in a row--> open --`cooldown_s` passed and a
    request is sent--> half-open (that request is the probe, no other is let through)
    --probe succeeded--> closed; --probe failed--> open again (a new cool-down).

    Outcomes of requests sent before the breaker opened move nothing while it is open or
    half-open: only the probe decides. `failure_threshold` 0: never opens. All of it
    lives on the router's event loop."""

    def __init__(
        self,
        failure_threshold: int,
        cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.clock = clock  # seconds; tests pass their own
        self._breakers: dict[str, _Breaker] = {}
        # Told of every transition (the router's metrics and log); set by its owner.
        self.on_transition: Callable[[Transition], None] = lambda transition: None

    @classmethod
    def of(cls, config: RouterConfig) -> CircuitBreakers:
        return cls(config.breaker_failure_threshold, config.breaker_cooldown_s)

    def state(self, url: str) -> BreakerState:
        breaker = self._breakers.get(url)
        return BreakerState.CLOSED if breaker is None else breaker.state

    def num_consecutive_failures(self, url: str) -> int:
        breaker = self._breakers.get(url)
        return 0 if breaker is None else breaker.num_consecutive_failures

    def allows(self, url: str) -> bool:
        """A request may be sent to `url` now (an open breaker past its cool-down allows
        one: the probe). Changes nothing."""
        breaker = self._breakers.get(url)
        if breaker is None or breaker.state is BreakerState.CLOSED:
            return True
        if breaker.state is BreakerState.OPEN:
            return self.clock() - breaker.opened_at_s >= self.cooldown_s
        return not breaker.probe_out

    def on_sent(self, url: str) -> Ticket:
        """A request goes to `url` (which `allows`): the probe if the breaker is not
        closed."""
        assert self.allows(url), f"{url}: the breaker lets no request through now"
        breaker = self._breakers.setdefault(url, _Breaker())
        if breaker.state is BreakerState.CLOSED:
            return Ticket(url, probe=False)
        breaker.probe_out = True
        if breaker.state is BreakerState.OPEN:
            self._move(url, breaker, BreakerState.HALF_OPEN)
        return Ticket(url, probe=True)

    def on_success(self, ticket: Ticket) -> None:
        """The rank answered (any status but a retryable failure)."""
        breaker = self._breakers[ticket.url]
        if breaker.state is BreakerState.CLOSED:
            breaker.num_consecutive_failures = 0
        elif ticket.probe and breaker.state is BreakerState.HALF_OPEN:
            breaker.num_consecutive_failures = 0
            self._move(ticket.url, breaker, BreakerState.CLOSED)

    def on_failure(self, ticket: Ticket) -> None:
        """The forward failed at the rank (refused, reset, 502/503, broken mid-stream)."""
        breaker = self._breakers[ticket.url]
        if breaker.state is BreakerState.CLOSED:
            breaker.num_consecutive_failures += 1
            if 0 < self.failure_threshold <= breaker.num_consecutive_failures:
                self._open(ticket.url, breaker)
        elif ticket.probe and breaker.state is BreakerState.HALF_OPEN:
            breaker.num_consecutive_failures += 1
            self._open(ticket.url, breaker)

    def on_abandoned(self, ticket: Ticket) -> None:
        """The request ended with no verdict on the rank (the client left first): a probe
        gives its place to the next request."""
        breaker = self._breakers[ticket.url]
        if ticket.probe and breaker.state is BreakerState.HALF_OPEN:
            breaker.probe_out = False

    def _open(self, url: str, breaker: _Breaker) -> None:
        breaker.opened_at_s = self.clock()
        self._move(url, breaker, BreakerState.OPEN)

    def _move(self, url: str, breaker: _Breaker, new: BreakerState) -> None:
        old, breaker.state = breaker.state, new
        breaker.probe_out = breaker.probe_out and new is BreakerState.HALF_OPEN
        self.on_transition(Transition(url, old, new))
