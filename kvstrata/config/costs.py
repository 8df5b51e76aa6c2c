"""`RequestCosts`: the options section bounding what one request, and one client, may cost
a rank before its engine sees them (prompts, choices, KV tokens, the answer's size,
engine requests in flight per client). `kvstrata serve` builds on it."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.config.options import ConfigError, flag, opt

# What one token of an answer costs in JSON: its text and framing (~16 bytes), and with
# logprobs each listed alternative (token text, logprob, bytes list: ~64 bytes). Used to
# estimate an answer's size before running it; generous, so honest requests pass.
ANSWER_BYTES_PER_TOKEN = 16
ANSWER_BYTES_PER_LOGPROB = 64
# The default bound on one request's KV tokens is this many KV pools: a request may queue
# more than fits at once (its choices run in turn), never without end.
REQUEST_TOKENS_PER_POOL = 4


@dataclass(frozen=True)
class RequestCosts:
    """Bounds checked at the door, after tokenizing: each refusal is a 400 (429 for the
    in-flight bound) naming the flag, and nothing reaches the engine."""

    max_prompts_per_request: int = opt(
        128, "Most prompts one /v1/completions request may list (else 400)."
    )
    max_choices_per_request: int = opt(
        256, "Most engine requests one HTTP request may make: prompts x n (else 400)."
    )
    max_request_tokens: int | None = opt(
        None,
        "Most KV tokens one request may ask for: each prompt's tokens plus n x "
        "max_tokens, summed over its prompts (else 400). Default: 4 x the KV pool's tokens.",
    )
    max_response_bytes: int = opt(
        64 * 2**20,
        "Largest answer one request may ask for, estimated before it runs from n "
        "x max_tokens per prompt (16 bytes a token, 64 more per logprob listed, the echoed "
        "prompt's too) (else 400).",
    )
    max_inflight_per_client: int = opt(
        1024,
        "Most engine requests (prompts x n) one client may have in flight on this rank "
        "(else 429). The client is the caller's address, or the one the router names for it "
        "(X-Kvstrata-Client, taken only with the cluster key). 0: no bound.",
    )

    def check_costs(self) -> None:
        for name in ("max_prompts_per_request", "max_choices_per_request", "max_response_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.max_request_tokens is not None and self.max_request_tokens < 1:
            raise ConfigError(f"--max-request-tokens must be >= 1, got {self.max_request_tokens}")
        if self.max_inflight_per_client < 0:
            raise ConfigError(
                f"--max-inflight-per-client must be >= 0, got {self.max_inflight_per_client}"
            )
