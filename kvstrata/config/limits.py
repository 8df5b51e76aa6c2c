"""What a front end accepts from a client: `IngressLimits`, the options section a rank's
server and the router share (body size, new connections per client address), and
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


@dataclass(frozen=True)
class IngressLimits:
    """The options section every HTTP front end (`ServerConfig`, `RouterConfig`) is built
    on: its flags read the same on `kvstrata serve` and `kvstrata router`, and
    `check_ingress` refuses bad values with one message for both."""

    max_body_bytes: int | None = opt(
        None, "Largest request body accepted (else 413). Default: what the longest allowed "
        "prompt needs (7 bytes per token id, 4 per character of text, plus 64 KiB); on the "
        "router, the longest prompt its --model's context holds, else 32 MiB.",
    )  # fmt: skip
    new_connections_per_s: float = opt(
        NEW_CONNECTIONS_PER_S, "New connections accepted per second from one client address "
        "(a token bucket's refill; 0: no limit). Beyond it: 429.",
    )  # fmt: skip
    new_connections_burst: int = opt(
        NEW_CONNECTIONS_BURST, "New connections one client address may open at once."
    )

    def check_ingress(self) -> None:
        check_size_limits(self)
        if self.new_connections_per_s < 0:
            raise ConfigError(
                f"--new-connections-per-s must be >= 0, got {self.new_connections_per_s}"
            )
        if self.new_connections_burst < 1:
            raise ConfigError(
                f"--new-connections-burst must be >= 1, got {self.new_connections_burst}"
            )


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
