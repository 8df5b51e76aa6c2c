"""An opt-in record of when each stage of a KV write ran, for finding where a write waits
(issue 17.2): with $KVSTRATA_WRITE_TIMELINE=DIR every process appends JSON lines to
DIR/<pid>.jsonl. Off (the default) each mark costs one attribute check."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import IO

ENV = "KVSTRATA_WRITE_TIMELINE"


class WriteTimeline:
    """Marks (`t_s` on the monotonic clock, which all processes of a host share) written
    under a lock, so lines from the engine thread and the sender workers never interleave."""

    def __init__(self, directory: str | None) -> None:
        self.enabled = bool(directory)
        self._directory = Path(directory) if directory else None
        self._file: IO[str] | None = None
        self._lock = threading.Lock()

    def mark(self, event: str, **fields: object) -> None:
        if not self.enabled:
            return
        line = json.dumps(
            {
                "t_s": time.monotonic(),
                "event": event,
                "thread": threading.current_thread().name,
                **fields,
            }
        )
        with self._lock:
            if self._file is None:
                assert self._directory is not None
                self._directory.mkdir(parents=True, exist_ok=True)
                self._file = open(self._directory / f"{os.getpid()}.jsonl", "a")  # noqa: SIM115
            self._file.write(line + "\n")
            self._file.flush()


TIMELINE = WriteTimeline(os.environ.get(ENV))
