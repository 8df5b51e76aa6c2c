"""Where streamed Mooncake tcp writes lose their overlap (issue 17.2): raw Transfer Engine
bandwidth, sender and receiver in two processes as in PD, while the GPU is idle and while
matmuls keep it busy from the sender's process, the receiver's process or a third one.

    PYTHONPATH=. python bench/experiments/wire_under_load.py --device cuda --json out.json
        [--total-bytes 1073741824] [--chunk-bytes 4194304] [--dst-device cuda|cpu]

A load in another process than the one whose memory a copy touches shares the GPU by time
slices (no MPS), which a load inside that process (its own stream) does not.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from kvstrata.disagg.transport.mooncake_config import MooncakeTransportConfig
from kvstrata.disagg.transport.mooncake_engine import start_engine

_BATCH_BYTES = 32 << 20  # in flight per batch_transfer_sync_write (the transport's limit)


class MatmulLoad:
    """Keeps `device` busy with bf16 matmuls on a stream of its own, from a thread of this
    process, until stopped; counts the matmuls done (so a run shows the load really ran)."""

    def __init__(self, device: str, size: int = 8192) -> None:
        self.device, self.size = device, size
        self.num_matmuls = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        a = torch.randn(self.size, self.size, dtype=dtype, device=self.device)
        stream = torch.cuda.Stream(self.device) if self.device.startswith("cuda") else None
        while not self._stop.is_set():
            with torch.cuda.stream(stream) if stream is not None else _nothing():
                for _ in range(8):
                    torch.mm(a, a)
            if stream is not None:
                stream.synchronize()  # a bounded queue, like an engine's step
            self.num_matmuls += 8

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.num_matmuls


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _peer_main(role: str, device: str, total_bytes: int, conn: Connection) -> None:
    """A receiver (registers `total_bytes` on `device`, answers its session and pointer)
    or a pure load process; both run a MatmulLoad while told to."""
    session, ptr, engine = "", 0, None
    if role == "receiver":
        engine, session = start_engine(MooncakeTransportConfig())
        dst = torch.zeros(total_bytes, dtype=torch.uint8, device=device)
        assert engine.register_memory(dst.data_ptr(), total_bytes) == 0
        ptr = dst.data_ptr()
    load = MatmulLoad("cuda" if torch.cuda.is_available() else "cpu")
    conn.send((session, ptr))
    while True:
        command = conn.recv()
        if command == "load":
            load.start()
            conn.send(0)
        elif command == "unload":
            conn.send(load.stop())
        else:
            conn.send(0)
            return


def timed_write(
    engine: Any, session: str, src_ptr: int, dst_ptr: int, total_bytes: int, chunk_bytes: int
) -> float:
    """Seconds to move `total_bytes` as `chunk_bytes` transfers, 32 MiB per batch."""
    offsets = list(range(0, total_bytes - chunk_bytes + 1, chunk_bytes))
    per_batch = max(1, _BATCH_BYTES // chunk_bytes)
    start_s = time.perf_counter()
    for i in range(0, len(offsets), per_batch):
        batch = offsets[i : i + per_batch]
        rc = engine.batch_transfer_sync_write(
            session, [src_ptr + o for o in batch], [dst_ptr + o for o in batch],
            [chunk_bytes] * len(batch),
        )  # fmt: skip
        assert rc == 0, f"raw transfer failed: {rc}"
    return time.perf_counter() - start_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dst-device", default=None, help="receiver memory (default: --device)")
    parser.add_argument("--total-bytes", type=int, default=1 << 30)
    parser.add_argument("--chunk-bytes", type=int, default=4 << 20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dst_device = args.dst_device or args.device
    ctx = mp.get_context("spawn")
    peers: dict[str, Connection] = {}
    procs = []
    for role in ("receiver", "load"):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_peer_main, args=(role, dst_device, args.total_bytes, there))
        proc.start()
        procs.append(proc)
        peers[role] = here
    session, dst_ptr = peers["receiver"].recv()
    peers["load"].recv()
    engine, _ = start_engine(MooncakeTransportConfig())
    src = torch.randint(0, 255, (args.total_bytes,), dtype=torch.uint8, device=args.device)
    assert engine.register_memory(src.data_ptr(), args.total_bytes) == 0
    assert engine.send_probe(session) == 0
    own_load = MatmulLoad(args.device)
    rows: dict[str, dict[str, float]] = {}

    def measure(name: str, start: Any, stop: Any) -> None:
        start()
        time.sleep(0.2)  # the load is running before the clock starts
        best_s = min(
            timed_write(engine, session, src.data_ptr(), dst_ptr, args.total_bytes,
                        args.chunk_bytes)
            for _ in range(args.repeats)
        )  # fmt: skip
        num_matmuls = stop()
        rows[name] = {"gb_per_s": args.total_bytes / best_s / 1e9, "load_matmuls": num_matmuls}
        print(f"{name:>22}: {rows[name]['gb_per_s']:6.2f} GB/s "
              f"(load ran {num_matmuls} matmuls)", flush=True)  # fmt: skip

    def remote(role: str, command: str) -> Any:
        peers[role].send(command)
        return peers[role].recv()

    measure("idle", lambda: None, lambda: 0)
    measure("load_in_sender", own_load.start, own_load.stop)
    measure("load_in_receiver", lambda: remote("receiver", "load"),
            lambda: remote("receiver", "unload"))  # fmt: skip
    measure("load_in_third_process", lambda: remote("load", "load"),
            lambda: remote("load", "unload"))  # fmt: skip
    measure("idle_again", lambda: None, lambda: 0)
    for role in peers:
        remote(role, "exit")
    for proc in procs:
        proc.join(30)
    engine.unregister_memory(src.data_ptr())
    result = {
        "machine": platform.node(), "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "src_device": args.device, "dst_device": dst_device, "total_bytes": args.total_bytes,
        "chunk_bytes": args.chunk_bytes, "rows": rows,
    }  # fmt: skip
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
