"""bench/experiments/trace_steps.py on a trace in the torch profiler's chrome format: each
step owns the kernels its launches correlate to, busy time is the union of its
compute-stream kernels, and side-stream and other-process work count only where they
overlap the step's span (exact figures on a hand-made trace)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "experiments"))
from trace_steps import step_rows, summarize

COMPUTE, SIDE = 7, 20


def event(cat: str, name: str, ts: float, dur: float, **args: int) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def write(path: Path, events: list[dict], base_ns: int = 0) -> Path:
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events, "baseTimeNanoseconds": base_ns}, f)
    return path


def test_steps_own_their_kernels_and_count_overlaps(tmp_path: Path) -> None:
    decode = [
        event("user_annotation", "kvstrata_step running=1 kv_tokens=100", 0, 50),
        event("cuda_runtime", "cudaGraphLaunch", 10, 5, correlation=1),
        event("user_annotation", "kvstrata_step running=2 kv_tokens=300", 100, 50),
        event("cuda_runtime", "cudaGraphLaunch", 110, 5, correlation=2),
        event("cuda_runtime", "cudaLaunchKernel", 120, 5, correlation=3),
        # step 1: two kernels with a 10 us gap; step 2: overlapping kernels
        event("kernel", "gemv", 1000, 100, stream=COMPUTE, correlation=1),
        event("kernel", "attention", 1110, 40, stream=COMPUTE, correlation=1),
        event("kernel", "gemv", 2000, 300, stream=COMPUTE, correlation=2),
        event("kernel", "argmax", 2250, 100, stream=COMPUTE, correlation=2),
        # the L1 -> L2 copier, launched in step 2, on its own stream; half inside the span
        event("kernel", "copy_chunks", 2300, 100, stream=SIDE, correlation=3),
        # a gpu annotation of the same name is not a step
        event("gpu_user_annotation", "kvstrata_step running=9 kv_tokens=9", 0, 9000),
    ]
    # the other rank's trace starts 0.5 ms later: its kernel at 600 us is at 1100 us here
    other = [event("kernel", "prefill_gemm", 600, 500, stream=COMPUTE, correlation=1)]
    rows, facts = step_rows(
        write(tmp_path / "d.json.gz", decode), write(tmp_path / "p.json.gz", other, 500_000)
    )
    assert facts["compute_stream"] == COMPUTE and facts["num_steps"] == 2
    assert [(r.running, r.kv_tokens) for r in rows] == [(1, 100), (2, 300)]
    assert [r.busy_us for r in rows] == [140, 350]
    assert [r.span_us for r in rows] == [150, 350]
    assert [r.side_us for r in rows] == [0, 50]
    assert [r.other_us for r in rows] == [50, 0]
    table = summarize(rows)
    assert [(t["running"], t["side_work"], t["steps"], t["busy_ms"]) for t in table] == [
        (1, False, 1, 0.14),
        (2, True, 1, 0.35),
    ]
    assert facts["top_us"]["side"] == {"copy_chunks": 100}


def test_a_trace_without_kernels_is_refused(tmp_path: Path) -> None:
    cpu_only = [event("user_annotation", "kvstrata_step running=1 kv_tokens=5", 0, 10)]
    with pytest.raises(ValueError, match="no GPU kernels"):
        step_rows(write(tmp_path / "c.json.gz", cpu_only), None)
