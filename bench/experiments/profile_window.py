"""A profile of several ranks over one window of a benchmark run: after `start_s` each
rank gets `POST /start_profile`, after `length_s` more `POST /stop_profile`; the traces'
paths (under the ranks' --profile-dir) are collected for `trace_steps`."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import httpx

MAX_STEPS = 20_000  # a bound on each trace, should the window outlast the run


@dataclass
class ProfileWindow:
    urls: list[str]
    start_s: float
    length_s: float
    traces: dict[str, str] = field(default_factory=dict)  # rank URL -> trace path
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> ProfileWindow:
        self._thread = threading.Thread(target=self._run, name="profile-window", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()  # a run shorter than the window: stop now
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        if self._stop.wait(self.start_s):
            return
        started = []
        for url in self.urls:
            answer = httpx.post(url + "/start_profile", json={"num_steps": MAX_STEPS}, timeout=60)
            if answer.status_code == 200:
                started.append(url)
            else:
                self.errors.append(f"{url}: {answer.text}")
        self._stop.wait(self.length_s)
        for url in started:
            answer = httpx.post(url + "/stop_profile", timeout=600)
            if answer.status_code == 200:
                self.traces[url] = answer.json()["trace_path"]
            else:
                self.errors.append(f"{url}: {answer.text}")
