"""`SimConfig`: every option of `kvstrata simulate` (the CLI is generated from it): the
routing simulation over a request trace, or (`--workload agentic`) the cache policies over
agent sessions (the `--agentic-*` shape flags it shares with `kvstrata bench`). Cost
defaults are the H200 measurements in docs/results.md (see config.H200_*)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.config import (
    H200_L2_TOKENS_PER_S,
    H200_L3_TOKENS_PER_S,
    H200_PREFILL_TOKENS_PER_S,
    H200_TRANSFER_TOKENS_PER_S,
    ConfigError,
    RouterConfig,
    opt,
)
from kvstrata.config.sessions import SessionOptions
from kvstrata.kvcache.hicache_policy import WRITE_POLICIES
from kvstrata.sim.agent_synth import AgenticOptions

SIM_POLICIES = ("round_robin", "shortest_queue", "total_tokens", "cache_aware", "ttft")
# agentic: an unbounded L1 (the reference), plain recency, and the session table's retention.
CACHE_POLICIES = ("infinite", "lru", "session")
_ROUTER_DEFAULTS = RouterConfig.__dataclass_fields__
_SESSION_DEFAULTS = SessionOptions.__dataclass_fields__


@dataclass(frozen=True)
class SimConfig(AgenticOptions):
    """A simulated cluster: N decode ranks, each with its own prefill lane, L1 and L2."""

    workload: str = opt(
        "trace",
        "trace: routing policies over --trace; agentic: cache policies over agent sessions "
        "(the --agentic-* flags), compared by --cache-policies.",
        ("trace", "agentic"),
    )
    trace: str = opt("", "Mooncake-format JSONL trace (timestamp ms, lengths, hash_ids).")
    num_decode: int = opt(4, "Decode ranks behind the router.")
    policy: str = opt(
        "all", f"Comma-separated --load-balance-method values, or all ({', '.join(SIM_POLICIES)})."
    )
    block_size: int = opt(512, "Tokens per trace hash id.")
    page_size: int = opt(16, "Tokens per KV page.")
    dp_routing_digest_chunk_size: int = opt(
        _ROUTER_DEFAULTS["dp_routing_digest_chunk_size"].default, "Digest chunk (tokens)."
    )
    dp_routing_max_extra_reqs: int = opt(
        _ROUTER_DEFAULTS["dp_routing_max_extra_reqs"].default, "cache_aware override bound."
    )
    dp_routing_cache_threshold: float = opt(
        _ROUTER_DEFAULTS["dp_routing_cache_threshold"].default,
        "cache_aware/ttft: see kvstrata router --help.",
    )
    l1_tokens_per_rank: int = opt(
        714_272, "L1 KV capacity per rank in tokens (H200, qwen3-8b: 44,642 pages of 16)."
    )
    l2_ratio: float = opt(2.0, "L2 host pages as a multiple of L1 pages (0: no L2).")
    l3: bool = opt(False, "A shared, unbounded L3 store behind every rank's L2.")
    prefill_tokens_per_s: float = opt(H200_PREFILL_TOKENS_PER_S, "Prompt tokens computed per s.")
    transfer_tokens_per_s: float = opt(
        H200_TRANSFER_TOKENS_PER_S, "Tokens of KV moved prefill -> decode per s."
    )
    l2_tokens_per_s: float = opt(H200_L2_TOKENS_PER_S, "Tokens of KV loaded back from L2 per s.")
    l3_tokens_per_s: float = opt(H200_L3_TOKENS_PER_S, "Tokens of KV read from L3 per s.")
    decode_s_per_token: float = opt(
        0.0167, "Seconds per output token (H200 W1: a 256-request decode step, 16.7 ms)."
    )
    load_poll_interval_s: float = opt(0.5, "Seconds between the router's polls of every rank.")
    digest_updates: str = opt(
        "events",
        "How the router learns a rank's digest and load: events (pushed as they change, "
        "`GET /kv_events`, arriving --kv-event-lag-s later) or poll (every "
        "--load-poll-interval-s).",
        ("events", "poll"),
    )
    kv_event_lag_s: float = opt(
        0.004,
        "events: seconds from a change on a rank to the router's copy showing it (measured "
        "p50 on the CPU box, docs/results.md issue 18.1).",
    )
    ttft_reuse_weight: float = opt(
        _ROUTER_DEFAULTS["ttft_reuse_weight"].default, "ttft: see kvstrata router --help."
    )
    ttft_calibrate: bool = opt(
        False,
        "ttft: scale each rank's estimates by observed TTFTs (off: the simulated ranks are "
        "identical and the router knows their true costs).",
    )
    arrival_speedup: float = opt(1.0, "Divide the trace's timestamps by this (more load).")
    max_requests: int = opt(0, "Simulate only the first N requests (0: all).")
    json_out: str = opt("", "Also write the results as JSON to this file.")
    # -- agentic --
    seed: int = opt(0, "agentic: seed of the synthetic sessions.")
    cache_policies: str = opt(
        ",".join(CACHE_POLICIES),
        "agentic: comma-separated runs: infinite (L1 holds everything), lru (recency), "
        "session (--radix-eviction-policy priority and the session table).",
    )
    agentic_l1_fraction: float = opt(
        0.25,
        "agentic: each rank's L1 holds this fraction of the pages its live sessions hold "
        "(mean at turn arrivals, measured in the infinite run); 0: --l1-tokens-per-rank.",
    )
    agentic_write_policy: str = opt(
        "write_through_selective",
        "agentic: when L1 pages are copied to L2 (a retained page is demoted anyway).",
        WRITE_POLICIES,
    )
    agentic_l2_inclusion: str = opt(
        "non_inclusive",
        "agentic: whether L2 includes L1 (see kvstrata serve --hicache-inclusion).",
        ("non_inclusive", "inclusive"),
    )
    session_paused_priority: int = opt(
        _SESSION_DEFAULTS["paused_priority"].default, "agentic: see kvstrata serve --help."
    )
    session_paused_retention_s: float = opt(
        _SESSION_DEFAULTS["paused_retention_s"].default, "agentic: see kvstrata serve --help."
    )
    session_queued_priority: int = opt(
        _SESSION_DEFAULTS["queued_priority"].default, "agentic: see kvstrata serve --help."
    )

    def __post_init__(self) -> None:
        self.check_agentic()
        if self.workload == "agentic":
            self._check_agentic_sim()
        elif not self.trace:
            raise ConfigError("--trace is required")
        for name in ("num_decode", "block_size", "page_size", "l1_tokens_per_rank"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if self.block_size % self.page_size:
            raise ConfigError("--block-size must be a multiple of --page-size")
        if self.dp_routing_digest_chunk_size % self.page_size:
            raise ConfigError("--dp-routing-digest-chunk-size must be a multiple of --page-size")
        for name in (
            "prefill_tokens_per_s",
            "transfer_tokens_per_s",
            "l2_tokens_per_s",
            "l3_tokens_per_s",
            "load_poll_interval_s",
            "arrival_speedup",
            "kv_event_lag_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
        if self.l2_ratio < 0 or self.decode_s_per_token < 0 or self.max_requests < 0:
            raise ConfigError("--l2-ratio, --decode-s-per-token and --max-requests must be >= 0")
        if self.digest_updates not in ("events", "poll"):
            raise ConfigError(f"--digest-updates: events or poll, not {self.digest_updates!r}")
        bad = [p for p in self.policies if p not in SIM_POLICIES]
        if bad:
            choices = ", ".join(SIM_POLICIES)
            raise ConfigError(f"--policy: unknown {bad[0]!r}; choose from {choices}")

    def _check_agentic_sim(self) -> None:
        bad = [p for p in self.cache_run_names if p not in CACHE_POLICIES]
        if bad or not self.cache_run_names:
            raise ConfigError(f"--cache-policies: choose from {', '.join(CACHE_POLICIES)}")
        if self.agentic_l1_fraction < 0:
            raise ConfigError("--agentic-l1-fraction must be >= 0")
        if self.agentic_l1_fraction and "infinite" not in self.cache_run_names:
            raise ConfigError(
                "--agentic-l1-fraction sizes L1 from the infinite run: list infinite in "
                "--cache-policies, or give --agentic-l1-fraction 0 and --l1-tokens-per-rank"
            )
        if self.agentic_write_policy not in WRITE_POLICIES:
            raise ConfigError(f"--agentic-write-policy: one of {', '.join(WRITE_POLICIES)}")
        if self.agentic_l2_inclusion not in ("non_inclusive", "inclusive"):
            raise ConfigError("--agentic-l2-inclusion: non_inclusive or inclusive")
        _ = self.session_options  # SessionOptions refuses bad values, naming the flag

    @property
    def cache_run_names(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.cache_policies.split(",") if p.strip())

    @property
    def session_options(self) -> SessionOptions:
        return SessionOptions(
            paused_priority=self.session_paused_priority,
            paused_retention_s=self.session_paused_retention_s,
            queued_priority=self.session_queued_priority,
        )

    @property
    def policies(self) -> tuple[str, ...]:
        if self.policy == "all":
            return SIM_POLICIES
        return tuple(p.strip() for p in self.policy.split(",") if p.strip())

    def router_config(self, policy: str) -> RouterConfig:
        """The router's options for `policy`: it knows the cluster's true costs."""
        return RouterConfig(
            prefill=("http://sim-prefill",),  # PD: the ttft policy counts the transfer
            decode=tuple(f"http://sim-decode-{i}" for i in range(self.num_decode)),
            load_balance_method=policy,
            dp_routing_digest_chunk_size=self.dp_routing_digest_chunk_size,
            dp_routing_max_extra_reqs=self.dp_routing_max_extra_reqs,
            dp_routing_cache_threshold=self.dp_routing_cache_threshold,
            ttft_prefill_tokens_per_s=self.prefill_tokens_per_s,
            ttft_transfer_tokens_per_s=self.transfer_tokens_per_s,
            ttft_l2_tokens_per_s=self.l2_tokens_per_s,
            ttft_l3_tokens_per_s=self.l3_tokens_per_s,
            ttft_reuse_weight=self.ttft_reuse_weight,
            ttft_calibrate=self.ttft_calibrate,
        )
