"""Reads a $KVSTRATA_WRITE_TIMELINE directory (kvstrata/disagg/transport/write_timeline.py)
and says where streamed writes wait: per write of the last room of each prefill process,
its queueing, its run, and the wire's speed while the prefill still computed vs after.

    python bench/experiments/write_timeline_report.py DIR [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def _load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _rooms(marks: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The process's write marks by room, in order. The engine thread marks `room_write`
    just before each write's `write_start`; the peer's worker runs writes in that order
    (one decode rank: one worker), so the k-th `write_run` is the k-th write, and its
    chunk marks and `write_done` come before the next `write_run`."""
    rooms: dict[str, list[dict[str, Any]]] = {}
    write_rooms: list[str] = []  # the room of each write, in start order
    room, num_runs = "", 0
    for mark in marks:
        event = mark["event"]
        if event == "room_write":
            room = str(mark["room"])
            continue
        if event == "write_start":
            write_rooms.append(room)
            owner = room
        else:  # a worker's mark: the write it is running
            num_runs += event == "write_run"
            owner = write_rooms[num_runs - 1] if 0 < num_runs <= len(write_rooms) else ""
        rooms.setdefault(owner, []).append(mark)
    return rooms


def room_report(marks: list[dict[str, Any]]) -> dict[str, Any]:
    """One room's writes (FIFO on one worker: the i-th start is the i-th run and done)."""
    of = {name: [m for m in marks if m["event"] == name] for name in
          ("write_start", "write_run", "write_done", "chunk_gathered",
           "chunk_landed", "chunk_scattered")}  # fmt: skip
    t0 = of["write_start"][0]["t_s"]
    compute_end_s = of["write_start"][-1]["t_s"]  # the last write starts when prefill ends
    writes = []
    for i, start in enumerate(of["write_start"]):
        run = of["write_run"][i] if i < len(of["write_run"]) else None
        done = of["write_done"][i] if i < len(of["write_done"]) else None
        writes.append({
            "num_pages": start["num_pages"],
            "start_s": start["t_s"] - t0,
            "queued_s": run["t_s"] - start["t_s"] if run else None,
            "run_s": done["t_s"] - run["t_s"] if run and done else None,
            "done_s": done["t_s"] - t0 if done else None,
        })  # fmt: skip
    # What landed before the prefill ended, over the span from the first gather to then,
    # and what landed after, over the span from then to the last landing.
    sizes = [g["num_bytes"] for g in of["chunk_gathered"]]
    landed = [(m["t_s"], sizes[i]) for i, m in enumerate(of["chunk_landed"]) if i < len(sizes)]
    first_s = of["chunk_gathered"][0]["t_s"] if sizes else compute_end_s
    during = sum(n for t, n in landed if t <= compute_end_s)
    after = sum(n for t, n in landed if t > compute_end_s)
    last_landed_s = max((t for t, _ in landed), default=compute_end_s)
    span_during_s, span_after_s = compute_end_s - first_s, last_landed_s - compute_end_s
    end_s = max((m["t_s"] for m in marks), default=t0)
    return {
        "compute_s": compute_end_s - t0,  # first write start -> last (the prefill's span)
        "room_s": end_s - t0,
        "tail_after_compute_s": end_s - compute_end_s,
        "num_writes": len(writes),
        "num_chunks": len(of["chunk_landed"]),
        "wire_gb_per_s_during_compute": during / span_during_s / 1e9 if span_during_s > 0 else None,
        "wire_gb_per_s_after_compute": after / span_after_s / 1e9 if span_after_s > 0 else None,
        "bytes_landed_during_compute": during,
        "bytes_landed_after_compute": after,
        "scatter_rtt_s_median": statistics.median(
            [s["t_s"] - lnd["t_s"] for lnd, s in zip(of["chunk_landed"], of["chunk_scattered"])]
        )
        if of["chunk_scattered"]
        else None,
        "writes": writes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report: dict[str, Any] = {}
    for path in sorted(Path(args.directory).glob("*.jsonl")):
        marks = _load(path)
        senders = [m for m in marks if m["event"].startswith(("room_", "write_", "chunk_"))]
        if not senders:
            report[path.stem] = {"scatters": sum(m["event"] == "scatter_end" for m in marks)}
            continue
        by_room = _rooms(senders)
        rooms = [r for r in by_room.values() if any(m["event"] == "write_start" for m in r)]
        report[path.stem] = {"num_rooms": len(rooms), "last_room": room_report(rooms[-1])}
        last = report[path.stem]["last_room"]
        print(f"pid {path.stem}: {len(rooms)} rooms; last: {last['num_writes']} writes, "
              f"compute {last['compute_s']:.3f} s, room {last['room_s']:.3f} s, tail "
              f"{last['tail_after_compute_s']:.3f} s; wire during compute "
              f"{last['wire_gb_per_s_during_compute']} GB/s, after "
              f"{last['wire_gb_per_s_after_compute']} GB/s")  # fmt: skip
        for w in last["writes"]:
            print("   ", {k: round(v, 4) if isinstance(v, float) else v for k, v in w.items()})
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
