"""`PromptBounds`: the largest prompt a server accepts (tokens), and what follows from it:
the most characters it tokenizes and the largest request body it reads. Derived in one
place so the body limit always follows the prompt limit instead of a fixed size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstrata.config.options import ConfigError, flag

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
