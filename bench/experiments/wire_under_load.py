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
import contextlib
import json
import multiprocessing as mp
import platform
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from kvstrata.config.mooncake import MooncakeTransportConfig
from kvstrata.disagg.transport.mooncake_engine import start_engine

_BATCH_BYTES = 32 << 20  # in flight per batch_transfer_sync_write (the transport's limit)


class MatmulLoad:
    """Keeps `device` busy from a thread of this process, on a stream of its own, until
    stopped; counts the rounds done (so a run shows the load really ran). Kinds:
    `matmul` (8 large bf16 matmuls a round), `small_kernels` (an engine-like round: 36 x 20
    small launches from Python), `graph_small_kernels` (the same round as one CUDA graph
    replay: launches without Python), `python_spin` (pure Python, no GPU: the GIL only)."""

    def __init__(self, device: str, kind: str = "matmul", size: int = 8192) -> None:
        self.device, self.kind, self.size = device, kind, size
        self.num_matmuls = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        cuda = self.device.startswith("cuda")
        if self.kind == "python_spin":
            while not self._stop.is_set():
                sum(i * i for i in range(10_000))
                self.num_matmuls += 1
            return
        dtype = torch.bfloat16 if cuda else torch.float32
        stream = torch.cuda.Stream(self.device) if cuda else None
        if self.kind == "matmul":
            a = torch.randn(self.size, self.size, dtype=dtype, device=self.device)
            step = lambda: [torch.mm(a, a) for _ in range(8)]  # noqa: E731
        else:
            x = torch.randn(2048, 4096, dtype=dtype, device=self.device)
            w = torch.randn(4096, 4096, dtype=dtype, device=self.device)

            def step() -> None:
                h = x
                for _ in range(36):
                    h = torch.mm(h, w)
                    for _ in range(19):
                        h = h * 0.5 + 0.25

            if self.kind == "graph_small_kernels":
                assert cuda, "CUDA graphs need CUDA"
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.stream(stream):
                    step()  # warm up outside the capture
                    with torch.cuda.graph(graph, stream=stream):
                        step()
                step = graph.replay
        while not self._stop.is_set():
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                step()
            if stream is not None:
                stream.synchronize()  # a bounded queue, like an engine's step
            self.num_matmuls += 1

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.num_matmuls


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


def timed_polled_write(
    engine: Any, session: str, src_ptr: int, dst_ptr: int, total_bytes: int, chunk_bytes: int
) -> float:
    """As `timed_write`, the way the transport's plain path writes: transfer_submit_write
    per chunk, 32 MiB in flight, transfer_check_status polled every 0.2 ms (each poll
    needs this thread to take the GIL back)."""
    offsets = list(range(0, total_bytes - chunk_bytes + 1, chunk_bytes))
    pending: list[int] = []
    start_s = time.perf_counter()
    while offsets or pending:
        while offsets and len(pending) * chunk_bytes < _BATCH_BYTES:
            o = offsets.pop(0)
            batch_id = engine.transfer_submit_write(session, src_ptr + o, dst_ptr + o, chunk_bytes)
            assert batch_id != 0, "submit failed"
            pending.append(batch_id)
        left = []
        for batch_id in pending:
            status = engine.transfer_check_status(batch_id)
            assert status >= 0, f"transfer failed: {status}"
            if status == 0:
                left.append(batch_id)
        pending = left
        time.sleep(0.0002)
    return time.perf_counter() - start_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dst-device", default=None, help="receiver memory (default: --device)")
    parser.add_argument("--total-bytes", type=int, default=1 << 30)
    parser.add_argument("--chunk-bytes", type=int, default=4 << 20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--sender-loads",
        default="matmul",
        help="loads run in the sender's process: matmul, small_kernels, "
        "graph_small_kernels, python_spin (comma-separated)",
    )
    parser.add_argument("--writers", default="sync", help="sync, poll (comma-separated)")
    parser.add_argument(
        "--no-placements",
        action="store_true",
        help="skip the matmul load in the receiver and in a third process",
    )
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
    rows: dict[str, dict[str, float]] = {}
    writers = {"sync": timed_write, "poll": timed_polled_write}

    def measure(name: str, start: Any, stop: Any, writer: str = "sync") -> None:
        start()
        time.sleep(0.2)  # the load is running before the clock starts
        best_s = min(
            writers[writer](engine, session, src.data_ptr(), dst_ptr, args.total_bytes,
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

    for writer in args.writers.split(","):
        measure(f"idle_{writer}", lambda: None, lambda: 0, writer)
        for kind in args.sender_loads.split(","):
            load = MatmulLoad(args.device, kind)
            measure(f"{kind}_in_sender_{writer}", load.start, load.stop, writer)
    if not args.no_placements:
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
