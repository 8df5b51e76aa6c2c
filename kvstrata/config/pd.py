"""`PDOptions`: a rank's PD role, its transport, and the decode rank's own choices (how long
a request may wait for pages, who prefills it, L3 restores beside the transfer). Decode-only
options given to another role are refused, naming the flag."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvstrata.config.mooncake import MooncakeTransportConfig
from kvstrata.config.options import ConfigError, check_choices, field_flag, flag, opt

# Fields that only a decode rank reads (each flag starts with --disaggregation-decode-).
DECODE_FIELDS = (
    "prealloc_timeout_s",
    "local_prefill",
    "local_prefill_max_tokens",
    "local_prefill_chunk_tokens",
    "local_prefill_tpot_budget",
    "parallel_restore",
)


@dataclass(frozen=True)
class PDOptions:
    """Prefill/decode disaggregation: the role and the transport every role reads, then the
    decode rank's options."""

    mode: str = opt(
        "null",
        "null: a unified server; prefill or decode: one side of a PD pair.",
        ("null", "prefill", "decode"),
        flag_name="disaggregation_mode",
    )
    transfer_backend: str = opt(
        "ipc",
        "How prefill writes KV pages into decode ranks.",
        ("ipc", "mooncake"),
        flag_name="disaggregation_transfer_backend",
    )
    ipc_io_backend: str = opt(
        "auto",
        "ipc transport on CUDA: kernel (one Triton kernel on the prefill GPU writes the pages "
        "into the decode pool, also across GPUs over peer access), direct (torch gather, "
        "copy, scatter), auto (kernel on CUDA).",
        ("auto", "kernel", "direct"),
        flag_name="disaggregation_ipc_io_backend",
    )
    mooncake_config: str = opt(
        "{}",
        "JSON options of the mooncake transfer engine (metadata server, protocol, ...).",
        flag_name="disaggregation_mooncake_config",
    )
    stream_writes: str = opt(
        "auto",
        "Prefill mode: on: start writing each prefill chunk's KV pages as soon as the chunk "
        "is done, so the transfer runs under the rest of the prefill; off: one write once "
        "the whole prompt is computed; auto: on, but for the mooncake transport on CUDA "
        "without host staging (its io threads' copies of GPU memory wait behind the queued "
        "prefill kernels, measured slower than one write at the end: docs/results.md).",
        ("auto", "on", "off"),
    )
    prealloc_timeout_s: float = opt(
        300.0,
        "Decode mode: a request that waited this long for KV pages to preallocate (the "
        "pool held by running requests, or by rooms a frozen prefill rank has not released) "
        "fails with 503 instead of waiting on. 0: no limit.",
        flag_name="disaggregation_decode_prealloc_timeout_s",
    )
    local_prefill: str = opt(
        "auto",
        "Decode mode: who prefills a request's uncached prompt tokens. never: a prefill "
        "rank, always; threshold: this rank itself when at most "
        "--disaggregation-decode-local-prefill-max-tokens are uncached; auto: whichever "
        "path has the lower estimated time to first token (local: this rank's measured "
        "step costs plus the delay to its running decodes; remote: the prefill rank's "
        "measured compute and queue plus the transfer at the observed bandwidth).",
        ("never", "threshold", "auto"),
        flag_name="disaggregation_decode_local_prefill",
    )
    local_prefill_max_tokens: int = opt(
        2048,
        "Decode mode, local prefill `threshold`: the most uncached tokens prefilled here.",
        flag_name="disaggregation_decode_local_prefill_max_tokens",
    )
    local_prefill_chunk_tokens: int = opt(
        8192,
        "Decode mode: prompt tokens a step may compute for local prefills (the running "
        "decodes share the step; with --max-num-batched-tokens, the smaller bounds it). "
        "Small chunks cost the decodes more, not less: each chunk is a step that reads "
        "every weight again, and a prompt in 1,024-token chunks slowed them 3x as many "
        "steps (H200, docs/results.md: TPOT +15% against +4% at 8,192).",
        flag_name="disaggregation_decode_local_prefill_chunk_tokens",
    )
    local_prefill_tpot_budget: float = opt(
        1.0,
        "Decode mode, local prefill `auto`: the share of the running decodes' recent step "
        "time (about the last minute) that this rank's own prompt tokens may take; past "
        "it, prompts go to a prefill rank until the share falls back, trading TTFT for "
        "TPOT (on one H200 at 2 in flight: 0.12 took TPOT from +15% to -7% of PD without "
        "a decode cache, at 1.4x the TTFT; docs/results.md). 1: no bound.",
        flag_name="disaggregation_decode_local_prefill_tpot_budget",
    )
    parallel_restore: bool = opt(
        True,
        "Decode mode with L3: a request whose prefix is still being read from L3 does not "
        "wait for it; its task goes out at once, claiming those pages, and the L3 read runs "
        "beside the prefill and the transfer. A page that does not arrive (gone, corrupt, "
        "past the prefetch timeout) is recomputed here from it to the end (the first token "
        "is kept). Off: the task waits for the read as the prefetch policy says.",
        flag_name="disaggregation_decode_parallel_restore",
    )

    def __post_init__(self) -> None:
        check_choices(self)
        fields = {f.name: f for f in dataclasses.fields(self)}
        given = [name for name in DECODE_FIELDS if getattr(self, name) != fields[name].default]
        if given and self.mode != "decode":
            raise ConfigError(
                f"{flag(field_flag(fields[given[0]]))} needs --disaggregation-mode decode "
                f"(got {self.mode})"
            )
        if self.prealloc_timeout_s < 0:
            raise ConfigError(
                "--disaggregation-decode-prealloc-timeout-s must be >= 0, got "
                f"{self.prealloc_timeout_s}"
            )
        self._check_local_prefill(fields)
        if self.transfer_backend == "mooncake":
            try:
                MooncakeTransportConfig.from_json(self.mooncake_config)
            except ValueError as e:
                raise ConfigError(str(e)) from e
        elif self.mooncake_config.strip() not in ("", "{}"):
            raise ConfigError(
                "--disaggregation-mooncake-config needs --disaggregation-transfer-backend mooncake"
            )

    def _check_local_prefill(self, fields: dict[str, dataclasses.Field[object]]) -> None:
        max_tokens, chunk_tokens = self.local_prefill_max_tokens, self.local_prefill_chunk_tokens
        if max_tokens < 0:
            raise ConfigError(
                f"--disaggregation-decode-local-prefill-max-tokens must be >= 0, got {max_tokens}"
            )
        if not 0.0 <= self.local_prefill_tpot_budget <= 1.0:
            raise ConfigError(
                "--disaggregation-decode-local-prefill-tpot-budget must be in [0, 1], got "
                f"{self.local_prefill_tpot_budget}"
            )
        if chunk_tokens < 1:
            raise ConfigError(
                "--disaggregation-decode-local-prefill-chunk-tokens must be >= 1, got "
                f"{chunk_tokens}"
            )
        if (
            self.local_prefill != "threshold"
            and max_tokens != fields["local_prefill_max_tokens"].default
        ):
            raise ConfigError(
                "--disaggregation-decode-local-prefill-max-tokens needs "
                f"--disaggregation-decode-local-prefill threshold (got {self.local_prefill})"
            )
        if (
            self.local_prefill == "never"
            and chunk_tokens != fields["local_prefill_chunk_tokens"].default
        ):
            raise ConfigError(
                "--disaggregation-decode-local-prefill-chunk-tokens needs "
                "--disaggregation-decode-local-prefill threshold or auto (got never)"
            )

    @property
    def is_decode(self) -> bool:
        return self.mode == "decode"
