"""`KeyFiles`: the keys `kvstrata launch` hands its children, as 0600 files in a private
directory (a key in a child's argv would be visible to every user of the host)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


class KeyFiles:
    """The keys handed to the children: one 0600 file each in a 0700 directory of the
    launcher's own (made on the first key), removed when the cluster stops. A child reads
    its key at start, so the files stay while a child may be started again."""

    def __init__(self) -> None:
        self.directory: Path | None = None

    def write(self, name: str, key: str) -> Path:
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="kvstrata-keys-"))  # mode 0700
        path = self.directory / name
        # O_EXCL: never write through a file (or link) someone else put there first.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        return path

    def remove(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
