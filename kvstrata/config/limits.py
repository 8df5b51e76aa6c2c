"""What a front end accepts from a client: `IngressLimits`, the options section a rank's
server and the router share (body size, connections: how many, how fast, how idle),
`ConnectionBudget`, the connection bounds that fit the open-file limit, and
`PromptBounds`, the largest prompt and the body and character limits derived from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstrata.config.options import ConfigError, flag, opt

# Characters per token the character bound allows. Real text averages 3-5 (English, code)
# or 1-2 (CJK) characters per token, and whitespace-heavy code rarely passes 8, so 32 is
# 4x beyond any realistic prompt: nothing the token bound would accept is refused here,
# while the tokenizer never runs over more than 32 characters per allowed token.
CHARS_PER_TOKEN_BOUND = 32
# A token id in a JSON list: up to 6 digits (vocabularies stay under 10^6) and a comma.
TOKEN_ID_JSON_BYTES = 7
# A character of JSON text: up to 4 bytes of UTF-8. (\uXXXX escapes take 6, but only
# non-ASCII text is escaped, and it runs at <= 2 characters per token: far inside.)
MAX_UTF8_BYTES_PER_CHAR = 4
# Everything but the prompt: sampling fields, chat roles and message framing, the model.
BODY_OVERHEAD_BYTES = 64 * 1024
# Per client address, on ranks and the router: generous enough for hundreds of clients
# behind one NAT (and for a router opening connections to a rank under a load spike).
NEW_CONNECTIONS_PER_S = 1000.0
NEW_CONNECTIONS_BURST = 2000
# Open files a process keeps besides its client connections (model files, CUDA, logs,
# pipes, its own calls to other ranks): at least this many, or an eighth of the limit.
FD_HEADROOM_MIN = 256
# Connections past --max-connections that serve /health only (probes see the process).
NUM_RESERVED_CONNECTIONS = 16
# Idle connections cost memory too: the default bound stops here, however many files.
MAX_DEFAULT_CONNECTIONS = 16_384
# At start the soft open-file limit is raised to the hard one, up to this: many systems
# start processes at 1024 though they allow far more, and every connection costs a file.
RAISED_OPEN_FILES = 65_536


@dataclass(frozen=True)
class IngressLimits:
    """The options section every HTTP front end (`ServerConfig`, `RouterConfig`) is built
    on: its flags read the same on `kvstrata serve` and `kvstrata router`, and
    `check_ingress` refuses bad values with one message for both."""

    max_body_bytes: int | None = opt(
        None,
        "Largest request body accepted (else 413). Default: what the longest allowed "
        "prompt needs (7 bytes per token id, 4 per character of text, plus 64 KiB); on the "
        "router, the longest prompt its --model's context holds, else 32 MiB.",
    )
    new_connections_per_s: float = opt(
        NEW_CONNECTIONS_PER_S,
        "New connections accepted per second from one client address "
        "(a token bucket's refill; 0: no limit). Beyond it: 429.",
    )
    new_connections_burst: int = opt(
        NEW_CONNECTIONS_BURST, "New connections one client address may open at once."
    )
    max_connections: int | None = opt(
        None,
        "Open connections held at once, all client addresses together. Past it a new "
        "connection takes the place of the longest idle one; if none idles, it answers 503 "
        f"with Retry-After (a further {NUM_RESERVED_CONNECTIONS} still serve /health). "
        "Default: what the open-file limit (ulimit -n, raised to the hard limit up to "
        f"{RAISED_OPEN_FILES} at start) leaves after {FD_HEADROOM_MIN} files or an eighth "
        "of it for the process itself (halved on the router: each relayed request holds a "
        f"connection to a rank), at most {MAX_DEFAULT_CONNECTIONS}.",
    )
    max_connections_per_address: int | None = opt(
        None,
        "Open connections one client address may hold at once (past it: its longest "
        "idle one is closed, or if none idles a 503). Default: 7/8 of --max-connections, so "
        "one address never takes them all.",
    )
    keep_alive_timeout_s: float = opt(
        5.0,
        "Close a connection that sends nothing for this long: a new one before its "
        "first request, or a kept-alive one between requests.",
    )
    header_timeout_s: float = opt(
        20.0,
        "Close a connection whose request head (line and headers) is not whole this "
        "long after its turn began (408).",
    )
    body_timeout_s: float = opt(
        30.0,
        "Close a connection whose request body takes longer than this plus one second "
        "per --min-body-bytes-per-s received.",
    )
    min_body_bytes_per_s: float = opt(
        1024.0, "The pace a request body must keep past --body-timeout-s."
    )

    def check_ingress(self) -> None:
        check_size_limits(self)
        for name in ("max_connections", "max_connections_per_address"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{flag(name)} must be >= 1, got {value}")
        for name in (
            "keep_alive_timeout_s",
            "header_timeout_s",
            "body_timeout_s",
            "min_body_bytes_per_s",
        ):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{flag(name)} must be > 0, got {value}")
        if self.new_connections_per_s < 0:
            raise ConfigError(
                f"--new-connections-per-s must be >= 0, got {self.new_connections_per_s}"
            )
        if self.new_connections_burst < 1:
            raise ConfigError(
                f"--new-connections-burst must be >= 1, got {self.new_connections_burst}"
            )


@dataclass(frozen=True)
class ConnectionBudget:
    """How many client connections a front end holds at once: `max_connections` served,
    `num_reserved` more for /health, `max_connections_per_address` of one address, all
    of them, times the files each costs, below the open-file limit with headroom left.
    `backlog`: connections accepted per event-loop turn (and the listen queue), before
    the gate can close the refused ones; the headroom covers a few turns of them."""

    max_connections: int
    max_connections_per_address: int
    num_reserved: int
    backlog: int

    @classmethod
    def of(
        cls, limits: IngressLimits, open_files: int, files_per_connection: int
    ) -> ConnectionBudget:
        """Raises ConfigError if --max-connections does not fit `open_files` (the soft
        RLIMIT_NOFILE) or the limit leaves no room at all."""
        headroom = max(FD_HEADROOM_MIN, open_files // 8)
        fitting = (open_files - headroom) // files_per_connection - NUM_RESERVED_CONNECTIONS
        if limits.max_connections is None:
            if fitting < 1:
                raise ConfigError(
                    f"the open-file limit {open_files} (ulimit -n) leaves no room for client "
                    f"connections after {headroom} for the process itself: raise it"
                )
            max_connections = min(fitting, MAX_DEFAULT_CONNECTIONS)
        elif limits.max_connections > fitting:
            raise ConfigError(
                f"--max-connections {limits.max_connections} does not fit the open-file limit "
                f"{open_files} (ulimit -n): at most {max(fitting, 0)} leave {headroom} files for "
                "the process itself; raise the limit or lower the flag"
            )
        else:
            max_connections = limits.max_connections
        per_address = limits.max_connections_per_address
        if per_address is None:
            per_address = max(1, max_connections - max_connections // 8)
        backlog = min(2048, max(16, headroom // 4))
        return cls(max_connections, per_address, NUM_RESERVED_CONNECTIONS, backlog)


@dataclass(frozen=True)
class PromptBounds:
    """Limits one request must fit, checked before the step each protects: the body
    size before parsing, the characters before tokenizing, the tokens before the engine."""

    max_prompt_tokens: int
    max_body_bytes: int

    @classmethod
    def derive(cls, max_prompt_tokens: int, max_body_bytes: int | None = None) -> PromptBounds:
        """`max_body_bytes` None: what the largest allowed prompt needs, as token ids or
        as text, whichever is larger, plus the rest of a request."""
        if max_body_bytes is None:
            ids_bytes = TOKEN_ID_JSON_BYTES * max_prompt_tokens
            text_bytes = MAX_UTF8_BYTES_PER_CHAR * CHARS_PER_TOKEN_BOUND * max_prompt_tokens
            max_body_bytes = BODY_OVERHEAD_BYTES + max(ids_bytes, text_bytes)
        return cls(max_prompt_tokens, max_body_bytes)

    @property
    def max_prompt_chars(self) -> int:
        return CHARS_PER_TOKEN_BOUND * self.max_prompt_tokens


def check_size_limits(config: Any) -> None:
    """--max-prompt-tokens and --max-body-bytes, where a config has them: None or >= 1."""
    for name in ("max_prompt_tokens", "max_body_bytes"):
        value = getattr(config, name, None)
        if value is not None and value < 1:
            raise ConfigError(f"{flag(name)} must be >= 1, got {value}")
