"""What an experiment reads off its ranks' /metrics after a run: the prefill ranks' PD
writes (bytes, seconds, bandwidth) and the decode ranks' step counters (overlapped and
synchronous steps, why overlap was lost, host seconds by part of the step)."""

from __future__ import annotations

import httpx


def pd_transfer(prefill_urls: list[str]) -> dict[str, float]:
    """What the prefill ranks' transfers wrote so far (summed /metrics counters): bytes,
    pages, seconds inside the writes, and the bandwidth they achieved in GB/s."""
    totals = {"pd_sent_bytes": 0.0, "pd_sent_pages": 0.0, "pd_send_seconds": 0.0}
    for url in prefill_urls:
        text = httpx.get(url + "/metrics", timeout=30).text
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name.removeprefix("kvstrata_") in totals:
                totals[name.removeprefix("kvstrata_")] += float(value)
    seconds = totals["pd_send_seconds"]
    totals["pd_send_gb_per_s"] = totals["pd_sent_bytes"] / seconds / 1e9 if seconds else 0.0
    return totals


def step_counters(urls: list[str]) -> dict[str, float]:
    """How the ranks' engine steps ran (summed /metrics gauges): steps overlapped and
    synchronous, why overlap was lost, host seconds by part of the step."""
    totals: dict[str, float] = {}
    for url in urls:
        for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
            name, _, value = line.partition(" ")
            key = name.removeprefix("kvstrata_")
            if key.startswith(("step", "overlap_lost_")) and "{" not in key:
                totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def transfer_line(label: str, transfer: dict[str, float]) -> str:
    return (
        f"{label}: {transfer['pd_sent_bytes'] / 1e9:.2f} GB in "
        f"{transfer['pd_send_seconds']:.2f} s of writes = "
        f"{transfer['pd_send_gb_per_s']:.1f} GB/s"
    )
