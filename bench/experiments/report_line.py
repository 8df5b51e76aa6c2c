"""One line per `kvstrata bench` report: TTFT mean/p99, TPOT mean/p99, ITL p90/p99 (ms),
hit rate, req/s, so a device call can bring back a run's figures in its log.
Usage: python bench/experiments/report_line.py REPORT.json [...]"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def line(path: str) -> str:
    r = json.loads(Path(path).read_text())
    ms = {
        k: {q: round(r[k][q] * 1e3, 1) for q in ("mean", "p90", "p99")}
        for k in ("ttft_s", "tpot_s", "itl_s")
    }
    hit = r.get("tiers", {}).get("hit_rate")
    return (
        f"{r['label']}: TTFT {ms['ttft_s']['mean']}/{ms['ttft_s']['p99']} TPOT "
        f"{ms['tpot_s']['mean']}/{ms['tpot_s']['p99']} ITL p90/p99 {ms['itl_s']['p90']}/"
        f"{ms['itl_s']['p99']} ms, hit {hit}, {r['request_throughput_per_s']:.2f} req/s, "
        f"{r['num_ok']}/{r['num_requests']} ok"
    )


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        if "ttft_s" in json.loads(Path(arg).read_text()):  # a report, not setup or counters
            print(line(arg))
