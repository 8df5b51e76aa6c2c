"""`BlockingCaller`: runs calls into a client library that can block for a long time (a
store whose server died or froze) on daemon worker threads, so no caller waits longer
than its timeout and a stuck call never keeps the process from exiting."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

T = TypeVar("T")


class CallTimeout(TimeoutError):
    """The call did not return within its timeout; it may still finish in the background."""


class BlockingCaller:
    """A fixed set of daemon threads. A call that times out keeps its thread until the
    library returns; a queued call whose caller already gave up is dropped unrun, so a
    dead server never builds a backlog of stale work."""

    def __init__(self, num_threads: int, name: str) -> None:
        if num_threads < 1:
            raise ValueError(f"need at least one worker thread, got {num_threads}")
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple] | None]
        self._queue = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._num_running = 0
        self._stopped = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        if self._stopped:
            future.cancel()
            future.set_running_or_notify_cancel()
        else:
            self._queue.put((future, fn, args))
        return future

    def call(self, fn: Callable[..., T], *args: Any, timeout_s: float) -> T:
        """`fn(*args)` on a worker; raises CallTimeout after `timeout_s`, or what fn raised."""
        future = self.submit(fn, *args)
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            future.cancel()  # only succeeds if no worker has started it yet
            raise CallTimeout(f"no answer within {timeout_s:g} s") from None

    def shutdown(self, wait_s: float) -> bool:
        """Stops taking work and drops queued calls; waits up to `wait_s` for running ones.
        Returns True when no call is running any more (the library is safe to close)."""
        self._stopped = True
        for _ in self._threads:
            self._queue.put(None)
        with self._idle:
            return self._idle.wait_for(lambda: self._num_running == 0, timeout=wait_s)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if self._stopped:
                future.cancel()
            if not future.set_running_or_notify_cancel():
                continue  # its caller gave up (timeout) or we are stopping
            with self._idle:
                self._num_running += 1
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the caller, never lost in a thread
                future.set_exception(e)
            finally:
                with self._idle:
                    self._num_running -= 1
                    self._idle.notify_all()
