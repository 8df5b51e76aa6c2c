"""Samples the CPU use of every thread of the processes whose command line contains a
pattern (default: kvstrata ranks), for finding what competes with a transfer (issue 17.2).
Writes, per window, each process's threads by name with their CPU share (1.0 = one core).

    python bench/experiments/thread_cpu.py --out threads.json [--pattern kvstrata]
        [--window-s 0.5] [--duration-s 120]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _matching_pids(pattern: str) -> dict[int, str]:
    pids = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if pattern in cmdline:
            pids[int(entry.name)] = cmdline[:160]
    return pids


def _thread_ticks(pid: int) -> dict[str, int]:
    """CPU ticks (user + system) by thread name, summed over threads sharing a name."""
    ticks: dict[str, int] = defaultdict(int)
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return {}
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks[name] += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--pattern", default="kvstrata")
    parser.add_argument("--window-s", type=float, default=0.5)
    parser.add_argument("--duration-s", type=float, default=120.0)
    args = parser.parse_args()
    windows = []
    before: dict[int, dict[str, int]] = {}
    end_s = time.monotonic() + args.duration_s
    commands: dict[int, str] = {}
    while time.monotonic() < end_s:
        t_s = time.monotonic()
        pids = _matching_pids(args.pattern)
        commands.update(pids)
        now = {pid: _thread_ticks(pid) for pid in pids}
        window = {}
        for pid, ticks in now.items():
            old = before.get(pid, {})
            shares = {name: (n - old.get(name, 0)) / _TICKS_PER_S / args.window_s
                      for name, n in ticks.items() if pid in before}  # fmt: skip
            busy = {name: round(s, 2) for name, s in shares.items() if s >= 0.05}
            if busy:
                window[str(pid)] = busy
        if window:
            windows.append({"t_s": round(t_s, 3), "threads": window})
        before = now
        time.sleep(max(0.0, args.window_s - (time.monotonic() - t_s)))
    Path(args.out).write_text(json.dumps({"commands": commands, "windows": windows}, indent=1))


if __name__ == "__main__":
    main()
