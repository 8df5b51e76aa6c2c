"""The model-server metrics the Gateway API Inference Extension's endpoint picker scrapes
by default (its model server protocol: queue length, running requests, KV-cache use, and
the cache config its prefix scorer reads), under vLLM's names, beside kvstrata's own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from kvstrata.engine.load import EngineLoad


class GatewayMetrics:
    """Set from the same load snapshot as the rank's own gauges, at every scrape."""

    def __init__(self, registry: CollectorRegistry, page_size: int, num_total_pages: int) -> None:
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Requests queued for admission (kvstrata_waiting_requests).",
            registry=registry,
        )
        self.running = Gauge(
            "vllm:num_requests_running",
            "Requests in the running batch (kvstrata_running_requests).",
            registry=registry,
        )
        # The picker's KV-cache scorer reads a fraction in [0, 1]; older pickers read the
        # earlier name. Pages that only hold cached prefixes are free to take, as in vLLM.
        self.kv_usage = [
            Gauge(name, "Fraction of L1 KV pages held by requests.", registry=registry)
            for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
        ]
        config = Gauge(
            "vllm:cache_config_info",
            "The L1 KV cache's page size (block_size) and pages (num_gpu_blocks).",
            ["block_size", "num_gpu_blocks"],
            registry=registry,
        )
        config.labels(block_size=str(page_size), num_gpu_blocks=str(num_total_pages)).set(1)

    def set(self, load: EngineLoad) -> None:
        self.waiting.set(load.num_waiting_reqs)
        self.running.set(load.num_running_reqs)
        usage = load.num_used_pages / load.num_total_pages if load.num_total_pages else 0.0
        for gauge in self.kv_usage:
            gauge.set(usage)
