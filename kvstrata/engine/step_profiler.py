"""A rank's on-demand torch profiler (`POST /start_profile`, `/stop_profile`): it owns the
running profile and the stepper wrapper that marks each engine step in the trace (the
requests running and the KV tokens they read), so kernels can be laid against steps."""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kvstrata.core import RequestOutput

if TYPE_CHECKING:
    from kvstrata.engine.engine import Engine
    from kvstrata.engine.stepper import Stepper

MAX_PROFILE_STEPS = 100_000  # bounds a trace's size when no stop comes


class ProfileStateError(RuntimeError):
    """Start while a profile runs, or stop while none does."""


@dataclass(frozen=True)
class ProfileStarted:
    trace_path: str
    num_steps: int  # the profile stops by itself after this many engine steps


@dataclass(frozen=True)
class ProfileStopped:
    trace_path: str
    num_steps: int  # engine steps recorded


class ProfiledStepper:
    """Wraps the engine's stepper while a profile runs: each step is one `kvstrata_step`
    range, and the profile stops by itself after its step budget."""

    def __init__(self, inner: Stepper, engine: Engine, owner: StepProfiler) -> None:
        self.inner = inner
        self.engine: Engine = weakref.proxy(engine)  # as the steppers': no cycle
        self.owner = owner

    @property
    def made_progress(self) -> bool:
        return self.inner.made_progress

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics()

    def step(self) -> list[RequestOutput]:
        running = self.engine.scheduler.running
        kv_tokens = sum(req.num_tokens for req in running)
        with record_function(f"kvstrata_step running={len(running)} kv_tokens={kv_tokens}"):
            outputs = self.inner.step()
        self.owner.after_step(self.engine)
        return outputs


class StepProfiler:
    """At most one profile at a time, written under `out_dir` (never a path a caller
    names). Started and stopped on the engine thread; each trace is exported on a thread
    of its own (seconds for a long one), which `stop`'s caller may wait for."""

    def __init__(self, out_dir: Path, name: str) -> None:
        self.out_dir = out_dir
        self.name = name
        self._profile: profile | None = None
        self._stepper: ProfiledStepper | None = None
        self._trace_path = ""
        self._num_steps = 0
        self._max_steps = 0
        self.unreported: ProfileStopped | None = None  # stopped by its budget, not yet by a call
        self.writer: threading.Thread | None = None  # exports the last stopped profile

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, engine: Engine, num_steps: int | None) -> ProfileStarted:
        if self._profile is not None:
            raise ProfileStateError("a profile is already running: POST /stop_profile first")
        self.out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self._trace_path = str(self.out_dir / f"{self.name}-{os.getpid()}-{stamp}.trace.json.gz")
        activities = [ProfilerActivity.CPU]
        if engine.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(activities=activities)
        self._profile.start()
        self._num_steps = 0
        self._max_steps = num_steps or MAX_PROFILE_STEPS
        self._stepper = ProfiledStepper(engine.stepper, engine, self)
        engine.stepper = self._stepper
        return ProfileStarted(self._trace_path, self._max_steps)

    def after_step(self, engine: Engine) -> None:
        self._num_steps += 1
        if self._num_steps >= self._max_steps:
            self.unreported = self.stop(engine)

    def stop(self, engine: Engine) -> ProfileStopped:
        """Stop the running profile (its trace is written by `writer`); with none running,
        the one its step budget stopped, once."""
        if self._profile is None or self._stepper is None:
            if self.unreported is None:
                raise ProfileStateError("no profile is running: POST /start_profile first")
            stopped, self.unreported = self.unreported, None
            return stopped
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)  # the last steps' kernels are in the trace
        stopped_profile = self._profile
        stopped_profile.stop()
        engine.stepper = self._stepper.inner
        self.writer = threading.Thread(
            target=stopped_profile.export_chrome_trace,
            args=(self._trace_path,),
            name="kvstrata-profile",
        )
        self.writer.start()
        self._profile = None
        self._stepper = None
        self.unreported = None
        return ProfileStopped(self._trace_path, self._num_steps)
