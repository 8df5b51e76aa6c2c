"""`FileStorage`: L3 pages as files under one directory, `<dir>/<first hash byte>/<hash>.kvpage`,
written atomically (unique temp file + rename) so several processes, possibly on several
hosts of a shared file system, can read and write the same directory at once."""

from __future__ import annotations

import errno
import io
import os
import re
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

from kvstrata.kvcache.hashing import hash_hex
from kvstrata.kvcache.storage.base import StorageBackend, check_key, log
from kvstrata.kvcache.storage.page_format import (
    HEADER_BYTES,
    PageCheck,
    check_header,
    encode_header,
    header_namespace,
    verify,
)

_PAGE_NAME = re.compile(r"^[0-9a-f]{64}\.kvpage$")
_TEMP_NAME = re.compile(r"^\.[0-9a-f]{64}\.[0-9a-f]{32}\.tmp$")
_SUBDIR_NAME = re.compile(r"^[0-9a-f]{2}$")
_STALE_TEMP_S = 3600.0  # a temp file this old was left by a writer that died: clear() removes it


class FileStorage(StorageBackend):
    """Invariants: a page file is only ever created by `os.replace` of a complete temp
    file, so a reader sees a whole page or none; two writers of one key write identical
    bytes, so the last rename wins harmlessly. Every read is verified anyway (header +
    checksum), which also covers files damaged or copied in from elsewhere."""

    name = "file"

    def __init__(
        self, directory: str | Path, page_bytes: int, namespace: bytes, fsync: bool = False
    ) -> None:
        super().__init__(page_bytes, namespace)
        self.directory = Path(directory)
        self.fsync = fsync  # fsync file and directory before a set counts (crash safety)
        self._file_bytes = HEADER_BYTES + page_bytes
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # sets will fail (counted); reads of what exists may still work
            log.warning("file storage: cannot create %s: %s", self.directory, e)

    def path_of(self, key: bytes) -> Path:
        key_hex = hash_hex(key)
        return self.directory / key_hex[:2] / f"{key_hex}.kvpage"

    # ---- queries and reads --------------------------------------------------------------

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        for i, key in enumerate(keys):
            check_key(key)
            if not self._present(key, "exists"):
                return i
        return len(keys)

    def batch_get(self, keys: Sequence[bytes], host_pages: Sequence[torch.Tensor]) -> list[bool]:
        self._check_args(keys, host_pages)
        start_s = time.perf_counter()
        results = [self._read(key, page) for key, page in zip(keys, host_pages)]
        self._count_gets(results, start_s)
        return results

    def _present(self, key: bytes, op: str) -> bool:
        # A file of the wrong size is as good as absent: a set may replace it.
        try:
            return os.stat(self.path_of(key)).st_size == self._file_bytes
        except FileNotFoundError:
            return False
        except OSError as e:
            self._note_error(op, 1, e)
            return False

    def _read(self, key: bytes, page: torch.Tensor) -> bool:
        path = self.path_of(key)
        try:
            with open(path, "rb", buffering=0) as f:
                header = bytearray(HEADER_BYTES)
                num_read = _read_into(f, memoryview(header))
                check = check_header(
                    memoryview(header)[:num_read], self.namespace, key, self.page_bytes
                )
                if check.ok and os.fstat(f.fileno()).st_size != self._file_bytes:
                    check = PageCheck.SHORT
                if check.ok:
                    # Straight into the L2 page: no intermediate buffer.
                    payload = memoryview(page.numpy()).cast("B")
                    num_read = _read_into(f, payload)
                    check = verify(header, payload[:num_read], self.namespace, key, self.page_bytes)
                if not check.ok:
                    self._note_corrupt(key, check)
                    self._remove_if_same(path, os.fstat(f.fileno()).st_ino)
                return check.ok
        except FileNotFoundError:
            return False
        except OSError as e:
            self._note_error("get", 1, e)
            return False

    def _remove_if_same(self, path: Path, inode: int) -> None:
        """Drops an unusable page so a later set can store a good one (sets skip present
        keys). Only if it is still the file we read: a writer may have just replaced it."""
        try:
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except OSError:
            pass  # gone already, or not ours to remove: the next read checks it again

    # ---- writes ---------------------------------------------------------------------------

    def batch_set(self, keys: Sequence[bytes], host_pages: Sequence[torch.Tensor]) -> list[bool]:
        self._check_args(keys, host_pages)
        start_s = time.perf_counter()
        results = []
        num_skipped = num_written = 0
        for key, page in zip(keys, host_pages):
            if self._present(key, "set"):
                num_skipped += 1
                results.append(True)
            elif self._write(key, page):
                num_written += 1
                results.append(True)
            else:
                results.append(False)
        self._count_sets(num_written, num_skipped, start_s)
        return results

    def _write(self, key: bytes, page: torch.Tensor) -> bool:
        path = self.path_of(key)
        payload = memoryview(page.numpy()).cast("B")
        header = encode_header(self.namespace, key, payload)
        temp_path = path.parent / f".{path.stem}.{uuid.uuid4().hex}.tmp"
        try:
            fd = _create_exclusive(temp_path)
        except OSError as e:
            self._note_error("set", 1, e, counter="num_set_failures")
            return False
        try:
            try:
                _write_all(fd, memoryview(header))
                _write_all(fd, payload)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp_path, path)
            if self.fsync:
                _fsync_dir(path.parent)
            return True
        except OSError as e:  # ENOSPC, EIO, EROFS, ...: leave no partial file behind
            _unlink_quietly(temp_path)
            self._note_error("set", 1, e, counter="num_set_failures")
            return False

    # ---- removal --------------------------------------------------------------------------

    def delete(self, keys: Sequence[bytes]) -> int:
        num_removed = 0
        for key in keys:
            check_key(key)
            try:
                os.unlink(self.path_of(key))
                num_removed += 1
            except FileNotFoundError:
                pass
            except OSError as e:
                self._note_error("delete", 1, e)
        return num_removed

    def clear(self) -> int:
        """Removes the page files of this namespace (another model sharing the directory
        keeps its pages) and temp files abandoned by dead writers; nothing else."""
        num_removed = 0
        try:
            subdirs = [e for e in os.scandir(self.directory) if _SUBDIR_NAME.match(e.name)]
        except OSError as e:
            self._note_error("clear", 0, e)
            return 0
        for subdir in subdirs:
            try:
                entries = list(os.scandir(subdir.path))
            except OSError as e:
                self._note_error("clear", 0, e)
                continue
            for entry in entries:
                if _PAGE_NAME.match(entry.name) and self._is_ours(entry.path):
                    num_removed += _unlink_quietly(entry.path)
                elif _TEMP_NAME.match(entry.name) and _older_than(entry, _STALE_TEMP_S):
                    _unlink_quietly(entry.path)
        return num_removed

    def _is_ours(self, path: str) -> bool:
        try:
            with open(path, "rb", buffering=0) as f:
                return header_namespace(f.read(HEADER_BYTES)) == self.namespace
        except OSError:
            return False


def _create_exclusive(temp_path: Path) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        return os.open(temp_path, flags, 0o644)
    except FileNotFoundError:  # first page of this fan-out subdirectory
        temp_path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(temp_path, flags, 0o644)


def _read_into(f: io.RawIOBase, buffer: memoryview) -> int:
    """Reads until `buffer` is full or the file ends; returns the bytes read."""
    total = 0
    while total < len(buffer):
        num_read = f.readinto(buffer[total:])
        if not num_read:
            break
        total += num_read
    return total


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        num_written = os.write(fd, data)
        if num_written <= 0:
            raise OSError(errno.EIO, "write made no progress")
        data = data[num_written:]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str | Path) -> int:
    try:
        os.unlink(path)
        return 1
    except OSError:
        return 0


def _older_than(entry: os.DirEntry[str], age_s: float) -> bool:
    try:
        return time.time() - entry.stat().st_mtime > age_s
    except OSError:
        return False
