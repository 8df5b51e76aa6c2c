"""The random model an experiment serves when it is given no --model: written to a temp
dir of the run's own (`TempModel`), with a progress line every few seconds while the
weights are built (a qwen3-8b preset is 16 GB: minutes on CPU), and removed however the
run ends: `stop_signals` turns SIGTERM and SIGHUP (and SIGINT, once) into an exception so
every cleanup runs, and a dir left by a SIGKILLed run is removed by the next run."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import TextIO

PREFIX = "kvstrata-exp-model-"  # then the pid of the run that owns it
PROGRESS_INTERVAL_S = 10.0
_GB = 1e9


class Stopped(Exception):
    """SIGTERM or SIGHUP reached the experiment (SIGINT raises KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Meanwhile the first SIGTERM, SIGHUP or SIGINT raises (Stopped, or KeyboardInterrupt)
    in the main thread, so `with` blocks and `finally` clauses clean up; later ones are
    ignored, so a second Ctrl-C cannot cut a cleanup short."""
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        raise KeyboardInterrupt if signum == signal.SIGINT else Stopped(signum)

    sigs = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    previous = {sig: signal.signal(sig, on_signal) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def remove_stale_dirs(temp_dir: Path) -> list[Path]:
    """Remove random models of runs that died without cleaning up (SIGKILL, a crash)."""
    removed = []
    for path in temp_dir.glob(f"{PREFIX}*-*"):
        pid = path.name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


class TempModel:
    """A random model in a temp dir of this run, built on enter (`preset`: a shape of
    kvstrata.model.presets.PRESETS; None: the tiny llama) and removed on exit."""

    def __init__(self, preset: str | None, out: TextIO = sys.stdout) -> None:
        self.preset = preset
        self.out = out
        self.directory: Path | None = None

    @property
    def path(self) -> Path:
        assert self.directory is not None, "enter the TempModel first"
        return self.directory / "model"

    def __enter__(self) -> TempModel:
        temp_dir = Path(tempfile.gettempdir())
        for stale in remove_stale_dirs(temp_dir):
            self._say(f"removed {stale}, left by a run that was killed")
        self.directory = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=temp_dir))
        try:
            self._build()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self._remove()

    def _build(self) -> None:
        from kvstrata.model.tiny import make_tiny_model

        name = self.preset or "tiny llama"
        self._say(f"building a random {name} model in {self.path} (removed at the end)")
        done = threading.Event()
        progress = threading.Thread(target=self._report, args=(done,), daemon=True)
        progress.start()
        try:
            arch = "qwen3" if self.preset else "llama"
            make_tiny_model(self.path, arch=arch, seed=0, preset=self.preset)
        finally:
            done.set()
            progress.join()
        self._say(f"made a random {name} model in {self.path}")

    def _report(self, done: threading.Event) -> None:
        """Every PROGRESS_INTERVAL_S: the weight bytes written so far, of how many."""
        start_s = time.monotonic()
        total_bytes: int | None = None
        while not done.wait(PROGRESS_INTERVAL_S):
            if total_bytes is None and self.preset is not None:
                total_bytes = _weight_bytes(self.path)
            # Allocated blocks, not sizes: safetensors may size its file before writing it.
            written = sum(p.stat().st_blocks * 512 for p in self.path.iterdir())
            of = f" of {total_bytes / _GB:.1f}" if total_bytes else ""
            self._say(
                f"building random weights: {written / _GB:.1f}{of} GB written, "
                f"{time.monotonic() - start_s:.0f} s"
            )

    def _remove(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)


def _weight_bytes(model_dir: Path) -> int | None:
    """Bytes of a preset's bf16 weights, from its config.json (written first), if there."""
    if not (model_dir / "config.json").exists():
        return None
    import torch

    from kvstrata.model.config import ModelConfig
    from kvstrata.model.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(ModelConfig.from_dir(str(model_dir)))
    return 2 * sum(p.numel() for p in model.parameters())


@contextlib.contextmanager
def model_dir(model: str, preset: str | None = None) -> Iterator[str]:
    """`model`, or a random model (tiny llama, or a `preset` shape) for the run's length."""
    if model:
        yield model
        return
    with TempModel(preset) as temp:
        yield str(temp.path)
