"""`SessionOptions`: what a rank's cache does with an agent session's pages between its
turns (kvcache/sessions.py): the retention a paused session keeps, and how many sessions
the rank remembers."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.config.options import ConfigError, opt
from kvstrata.core import MAX_CACHE_PRIORITY as MAX_PRIORITY


@dataclass(frozen=True)
class SessionOptions:
    """Per-state retention defaults of agent sessions (a request's own `priority` /
    `retention_seconds` hint, when stronger, wins)."""

    paused_priority: int = opt(
        50,
        "Eviction priority (0-99) of a paused session's pages, between its turns (read "
        "by --radix-eviction-policy priority; demoted to L2/L3 rather than dropped when "
        "L1 needs room and they are still retained). 0: sessions are plain LRU.",
        flag_name="session_paused_priority",
    )
    paused_retention_s: float = opt(
        900.0,
        "Seconds a paused session's pages keep that priority without a hit (agents' "
        "p99 pause between turns is ~11 minutes in published traces).",
        flag_name="session_paused_retention_s",
    )
    queued_priority: int = opt(
        60,
        "Eviction priority (0-99) of a session's context from its next turn's arrival "
        "until that turn ends (above --session-paused-priority: a queued turn's pages go "
        "after those of sessions whose next turn has not come; on a saturated rank this "
        "is what keeps the turns at the head of the queue from recomputing, "
        "docs/agentic-workload.md). 0: off.",
        flag_name="session_queued_priority",
    )
    max_sessions: int = opt(
        65536,
        "Sessions a rank remembers (least recently used are forgotten first: their pages "
        "keep their hints until those lapse).",
        flag_name="session_max_sessions",
    )
    max_session_tokens: int = opt(
        1 << 26,
        "Context tokens the remembered sessions may hold in all (4 bytes each on the "
        "host: 256 MiB by default); past it the least recently used are forgotten.",
        flag_name="session_max_tokens",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.paused_priority <= MAX_PRIORITY:
            raise ConfigError(
                f"--session-paused-priority must be in [0, {MAX_PRIORITY}], "
                f"got {self.paused_priority}"
            )
        if not 0 <= self.queued_priority <= MAX_PRIORITY:
            raise ConfigError(
                f"--session-queued-priority must be in [0, {MAX_PRIORITY}], "
                f"got {self.queued_priority}"
            )
        if not self.paused_retention_s > 0:
            raise ConfigError(
                f"--session-paused-retention-s must be > 0, got {self.paused_retention_s}"
            )
        if self.max_sessions < 1:
            raise ConfigError(f"--session-max-sessions must be >= 1, got {self.max_sessions}")
        if self.max_session_tokens < 1:
            raise ConfigError(f"--session-max-tokens must be >= 1, got {self.max_session_tokens}")
