"""Prometheus metrics of one rank, in a registry of its own: token and request counters
(the same numbers `usage` reports), latency histograms, and KV page / queue / invariant
gauges that are refreshed on every scrape (and the Gateway API Inference Extension's
names for three of them, gateway_metrics.py)."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvstrata.core import RequestOutput
from kvstrata.engine.invariants import InvariantReport
from kvstrata.engine.load import EngineLoad
from kvstrata.server.gateway_metrics import GatewayMetrics

TIERS = ("l1", "l2", "l3")
_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    """Thread-safe (prometheus_client locks internally); fed on the event loop."""

    def __init__(self, page_size: int = 0, num_total_pages: int = 0) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.gateway = GatewayMetrics(r, page_size, num_total_pages)
        self.prompt_tokens = Counter(
            "kvstrata_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            "kvstrata_generation_tokens", "Output tokens of finished requests.", registry=r
        )
        self.cached_tokens = Counter(
            "kvstrata_cached_tokens",
            "Prompt tokens served from a cache tier.",
            ["tier"],
            registry=r,
        )
        self.transferred_tokens = Counter(
            "kvstrata_transferred_tokens", "Prompt tokens received by PD transfer.", registry=r
        )
        self.prefill_requests = Counter(
            "kvstrata_pd_prefill_requests",
            "Decode rank: finished requests by where their "
            "uncached prompt was prefilled (local: this rank; remote: a prefill rank).",
            ["path"],
            registry=r,
        )
        self.prefill_tokens = Counter(
            "kvstrata_pd_prefill_tokens",
            "Decode rank: uncached prompt tokens by where they "
            "were prefilled (local: computed here; remote: computed by a prefill rank and "
            "transferred).",
            ["path"],
            registry=r,
        )
        self.computed_prompt_tokens = Counter(
            "kvstrata_computed_prompt_tokens",
            "Prompt tokens this rank computed (neither "
            "served from a cache tier nor received by PD transfer).",
            registry=r,
        )
        self.spliced_turns = Counter(
            "kvstrata_chat_spliced_turns",
            "Assistant messages of chat histories replaced by the tokens this rank "
            "generated for them (--chat-generated-turns).",
            registry=r,
        )
        self.requests = Counter(
            "kvstrata_requests",
            "Finished requests by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "kvstrata_time_to_first_token_seconds",
            "From submission to the first token.",
            buckets=_TTFT_BUCKETS_S,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "kvstrata_time_per_output_token_seconds",
            "Mean gap between output tokens.",
            buckets=_TPOT_BUCKETS_S,
            registry=r,
        )
        self.kv_pages = Gauge("kvstrata_kv_pages", "L1 KV pages by state.", ["state"], registry=r)
        self.running_requests = Gauge(
            "kvstrata_running_requests", "Requests in the running batch.", registry=r
        )
        self.waiting_requests = Gauge(
            "kvstrata_waiting_requests", "Requests queued for admission.", registry=r
        )
        self.invariants_ok = Gauge(
            "kvstrata_invariants_ok",
            "1 if every check of /debug/invariants held at the last "
            "check (pages per tier add up; locks, rooms, prefetches have live requests); a "
            "scrape checks again once that is --metrics-invariants-interval-s old.",
            registry=r,
        )
        self.invariant_violations = Gauge(
            "kvstrata_invariant_violations",
            "Checks of /debug/invariants broken at the last check.",
            registry=r,
        )
        self.invariant_counts = Gauge(
            "kvstrata_invariant_count",
            "What /debug/invariants counted: pages per tier and "
            "state, lock pins, rooms, prefetches, requests.",
            ["name"],
            registry=r,
        )
        self.pd_kv_failures = Gauge(
            "kvstrata_pd_kv_failures",
            "Decode rank: failed rooms by cause (unreachable, "
            "timeout, prefill_error, transfer, mismatch) and outcome (retried on another "
            "prefill rank, recomputed here, failed).",
            ["cause", "outcome"],
            registry=r,
        )
        for tier in TIERS:  # export zeros for every tier from the start
            self.cached_tokens.labels(tier=tier)
        self._cache_gauges: dict[str, Gauge] = {}

    def observe_first_token(self, ttft_s: float) -> None:
        self.time_to_first_token.observe(ttft_s)

    def observe_finished(self, out: RequestOutput, decode_s: float | None) -> None:
        """Count one finished request; `decode_s` spans its first to its last token."""
        usage = out.cache_usage
        self.prompt_tokens.inc(len(out.prompt_ids))
        self.generation_tokens.inc(len(out.output_ids))
        for tier, tokens in zip(TIERS, (usage.l1_tokens, usage.l2_tokens, usage.l3_tokens)):
            self.cached_tokens.labels(tier=tier).inc(tokens)
        self.transferred_tokens.inc(usage.transferred_tokens)
        self.computed_prompt_tokens.inc(
            max(len(out.prompt_ids) - usage.cached_tokens - usage.transferred_tokens, 0)
        )
        if usage.prefill_path is not None:
            path = usage.prefill_path.value
            self.prefill_requests.labels(path=path).inc()
            tokens = usage.local_prefill_tokens if path == "local" else usage.transferred_tokens
            self.prefill_tokens.labels(path=path).inc(tokens)
        reason = out.finish_reason.value if out.finish_reason is not None else "unknown"
        self.requests.labels(finish_reason=reason).inc()
        if decode_s is not None and len(out.output_ids) > 1:
            self.time_per_output_token.observe(decode_s / (len(out.output_ids) - 1))

    def render(
        self,
        load: EngineLoad,
        cache: dict[str, float] | None = None,
        invariants: InvariantReport | None = None,
        pd_failures: Mapping[tuple[str, str], int] | None = None,
    ) -> bytes:
        """The exposition text, with the gauges set from `load` first, one gauge per
        cache-tier counter in `cache` (hits per tier, copies, L3 I/O, evictions, errors),
        and the outcome and counts of the invariants check."""
        if invariants is not None:
            self.invariants_ok.set(int(invariants.ok))
            self.invariant_violations.set(len(invariants.violations))
            for name, value in invariants.counts.items():
                self.invariant_counts.labels(name=name).set(value)
        for name, cache_value in (cache or {}).items():
            gauge = self._cache_gauges.get(name)
            if gauge is None:
                gauge = self._cache_gauges[name] = Gauge(
                    f"kvstrata_{name}",
                    f"Cache tiers and PD transfer: {name.replace('_', ' ')}.",
                    registry=self.registry,
                )
            gauge.set(cache_value)
        for (cause, outcome), count in (pd_failures or {}).items():
            self.pd_kv_failures.labels(cause=cause, outcome=outcome).set(count)
        self.kv_pages.labels(state="free").set(load.num_free_pages)
        self.kv_pages.labels(state="cached").set(load.num_cached_pages)
        self.kv_pages.labels(state="used").set(load.num_used_pages)
        self.running_requests.set(load.num_running_reqs)
        self.waiting_requests.set(load.num_waiting_reqs)
        self.gateway.set(load)
        return generate_latest(self.registry)
