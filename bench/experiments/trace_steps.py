"""Where a rank's GPU time goes, step by step, from a `/start_profile` trace: each engine
step (`kvstrata_step running=R kv_tokens=T`) owns the kernels and copies it launched
(CUPTI correlation ids); per step the compute stream's busy time and span, the side
streams' work (L1<->L2 copies, KV staging) overlapping it, and optionally another
process's kernels (the other rank under MPS, from its own trace) over the same window.

Usage: python bench/experiments/trace_steps.py TRACE [--other TRACE] [--out FILE.json]"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STEP_RE = re.compile(r"kvstrata_step running=(\d+) kv_tokens=(\d+)")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class GpuOp:
    name: str
    cat: str
    stream: int
    start_us: float
    end_us: float


@dataclass
class StepRow:
    running: int
    kv_tokens: int
    busy_us: float  # compute-stream kernel time of the step (union)
    span_us: float  # first to last compute-stream kernel of the step
    side_us: float  # side-stream work overlapping the span
    other_us: float  # the other process's kernels overlapping the span


def load_events(path: Path) -> tuple[list[dict[str, Any]], float]:
    """The trace's events and its base time (us), so two processes' traces line up."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    base_us = float(trace.get("baseTimeNanoseconds", 0)) / 1e3
    return trace["traceEvents"], base_us


def gpu_ops(events: list[dict[str, Any]], base_us: float) -> list[tuple[int | None, GpuOp]]:
    ops = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATS:
            args = e.get("args", {})
            start_us = base_us + float(e["ts"])
            op = GpuOp(
                e["name"],
                e["cat"],
                int(args.get("stream", -1)),
                start_us,
                start_us + float(e.get("dur", 0)),
            )
            ops.append((args.get("correlation"), op))
    return ops


def union_us(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of `intervals` clipped to [lo, hi]."""
    total, end = 0.0, lo
    for start, stop in sorted(intervals):
        start, stop = max(start, end), min(stop, hi)
        if stop > start:
            total += stop - start
            end = stop
    return total


class Timeline:
    """Intervals sorted by start, for overlap queries over a window."""

    def __init__(self, intervals: list[tuple[float, float]]) -> None:
        self.intervals = sorted(intervals)
        self.starts = [s for s, _ in self.intervals]
        self.longest_us = max((e - s for s, e in self.intervals), default=0.0)

    def overlap_us(self, lo: float, hi: float) -> float:
        first = bisect.bisect_left(self.starts, lo - self.longest_us)
        last = bisect.bisect_right(self.starts, hi)
        return union_us(self.intervals[first:last], lo, hi)


def step_rows(path: Path, other: Path | None) -> tuple[list[StepRow], dict[str, Any]]:
    events, base_us = load_events(path)
    steps = sorted(
        (base_us + float(e["ts"]), base_us + float(e["ts"]) + float(e.get("dur", 0)), m)
        for e in events
        if e.get("cat") == "user_annotation" and (m := STEP_RE.match(e.get("name", "")))
    )
    step_starts = [s for s, _, _ in steps]
    step_of_correlation: dict[int, int] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime":
            ts = base_us + float(e["ts"])
            i = bisect.bisect_right(step_starts, ts) - 1
            if i >= 0 and ts <= steps[i][1]:
                step_of_correlation[e.get("args", {}).get("correlation")] = i
    ops = gpu_ops(events, base_us)
    kernel_us: dict[int, float] = defaultdict(float)
    for _, op in ops:
        if op.cat == "kernel":
            kernel_us[op.stream] += op.end_us - op.start_us
    if not kernel_us:
        raise ValueError(f"{path}: no GPU kernels in this trace (a CPU rank's?)")
    compute_stream = max(kernel_us, key=kernel_us.__getitem__)
    side = Timeline([(op.start_us, op.end_us) for _, op in ops if op.stream != compute_stream])
    other_line = Timeline([])
    if other is not None:
        other_events, other_base = load_events(other)
        other_line = Timeline(
            [
                (op.start_us, op.end_us)
                for _, op in gpu_ops(other_events, other_base)
                if op.cat == "kernel"
            ]
        )
    by_step: dict[int, list[GpuOp]] = defaultdict(list)
    for correlation, op in ops:
        i = step_of_correlation.get(correlation)
        if i is not None and op.stream == compute_stream:
            by_step[i].append(op)
    rows = []
    for i, step_ops in sorted(by_step.items()):
        lo = min(op.start_us for op in step_ops)
        hi = max(op.end_us for op in step_ops)
        busy = union_us([(op.start_us, op.end_us) for op in step_ops], lo, hi)
        match = steps[i][2]
        rows.append(
            StepRow(
                int(match[1]),
                int(match[2]),
                busy,
                hi - lo,
                side.overlap_us(lo, hi),
                other_line.overlap_us(lo, hi),
            )
        )
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for _, op in ops:
        where = "compute" if op.stream == compute_stream else "side"
        totals[where][op.name[:60]] += op.end_us - op.start_us
    top = {
        where: dict(sorted(names.items(), key=lambda kv: -kv[1])[:12])
        for where, names in totals.items()
    }
    return rows, {"compute_stream": compute_stream, "num_steps": len(steps), "top_us": top}


def summarize(rows: list[StepRow]) -> list[dict[str, Any]]:
    """Per (running, whether side work overlapped): steps, and busy/span/overlaps in ms."""
    groups: dict[tuple[int, bool], list[StepRow]] = defaultdict(list)
    for row in rows:
        groups[(row.running, row.side_us > 0)].append(row)
    table = []
    for (running, with_side), group in sorted(groups.items()):

        def ms(field: str, group: list[StepRow] = group) -> float:
            return round(statistics.fmean(getattr(r, field) for r in group) / 1e3, 3)

        table.append(
            {
                "running": running,
                "side_work": with_side,
                "steps": len(group),
                "kv_tokens": round(statistics.fmean(r.kv_tokens for r in group)),
                "busy_ms": ms("busy_us"),
                "span_ms": ms("span_us"),
                "side_ms": ms("side_us"),
                "other_ms": ms("other_us"),
            }
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--other", type=Path, default=None, help="another process's trace")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows, facts = step_rows(args.trace, args.other)
    table = summarize(rows)
    for line in table:
        print(json.dumps(line))
    print(json.dumps(facts["top_us"], indent=1))
    if args.out is not None:
        args.out.write_text(
            json.dumps({"table": table, **facts, "rows": [asdict(r) for r in rows]}) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
