"""`FileStorage`: L3 pages as files under one directory, `<dir>/<first hash byte>/<hash>.kvpage`,
written atomically (unique temp file + rename) so several processes, possibly on several
hosts of a shared file system, can read and write the same directory at once; private
(0600 files, 0700 directories) and MAC-signed unless configured otherwise (`L3Trust`)."""

from __future__ import annotations

import errno
import io
import os
import re
import stat
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from kvstrata.kvcache.hashing import hash_hex
from kvstrata.kvcache.storage.base import StorageBackend, check_key, log
from kvstrata.kvcache.storage.file_access import directory_key, prepare_directory
from kvstrata.kvcache.storage.page_format import (
    HEADER_BYTES,
    PageCheck,
    PageMac,
    check_header,
    encode_header,
    header_namespace,
    verify,
)
from kvstrata.kvcache.storage.trust import L3Trust, process_mac_key

_PAGE_NAME = re.compile(r"^[0-9a-f]{64}\.kvpage$")
_TEMP_NAME = re.compile(r"^\.[0-9a-f]{64}\.[0-9a-f]{32}\.tmp$")
_SUBDIR_NAME = re.compile(r"^[0-9a-f]{2}$")
_STALE_TEMP_S = 3600.0  # a temp file this old was left by a writer that died: clear() removes it
# Reads never follow a link nor wait on a FIFO someone put in a shared directory.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
DEFAULT_THREADS = min(4, os.cpu_count() or 1)


class FileStorage(StorageBackend):
    """Invariants: a page file is only ever created by `os.replace` of a complete temp
    file, so a reader sees a whole page or none; two writers of one key write equivalent
    pages, so the last rename wins harmlessly. Every read is verified (header + MAC) in a
    buffer of the reading thread before a byte reaches the L2 page, which also covers
    files damaged, copied in from elsewhere, or written by someone without the key."""

    name = "file"

    def __init__(
        self,
        directory: str | Path,
        page_bytes: int,
        namespace: bytes,
        fsync: bool = False,
        trust: L3Trust | None = None,
        threads: int = DEFAULT_THREADS,
    ) -> None:
        if threads < 1:
            raise ValueError(f"file storage option threads must be at least 1, got {threads}")
        self.directory = Path(directory)
        self.trust = trust or L3Trust()
        self.fsync = fsync  # fsync file and directory before a set counts (crash safety)
        self._file_bytes = HEADER_BYTES + page_bytes
        self._modes = self.trust.modes
        usable = prepare_directory(self.directory, self.trust)  # refuses a shared one
        key = self.trust.mac_key
        if key is None and usable:
            key = directory_key(self.directory, self.trust)
        if key is None:
            log.warning(
                "file storage: no L3 page key for %s; pages this process writes are "
                "readable by it alone",
                self.directory,
            )
            key = process_mac_key()
        super().__init__(page_bytes, namespace, PageMac(key))
        self._buffers = threading.local()  # each I/O thread's page-sized read buffer
        # The pages of one batch are read (MAC-checked) and written on this many threads:
        # the MAC runs at ~1 GB/s per core and releases the GIL. 1: in the caller's thread.
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="kv-file") if threads > 1 else None
        )

    def _each_page(
        self,
        fn: Callable[[bytes, torch.Tensor], bool],
        keys: Sequence[bytes],
        host_pages: Sequence[torch.Tensor],
    ) -> list[bool]:
        """fn(key, page) for every page, in order; spread over the pool when it has one."""
        if self._pool is None or len(keys) < 2:
            return [fn(key, page) for key, page in zip(keys, host_pages)]
        return list(self._pool.map(fn, keys, host_pages))

    def close(self) -> None:
        pool, self._pool = self._pool, None  # later batches run in the caller's thread
        if pool is not None:
            pool.shutdown(wait=True)

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
        results = self._each_page(self._read, keys, host_pages)
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
            fd = os.open(path, _READ_FLAGS)
        except FileNotFoundError:
            return False
        except OSError as e:  # ELOOP: a link where a page should be
            self._note_error("get", 1, e)
            return False
        try:
            with open(fd, "rb", buffering=0) as f:
                check = self._read_verified(f, key)
                if check.ok:
                    page.copy_(torch.from_numpy(self._buffer()))
                else:
                    self._note_corrupt(key, check)
                    self._remove_if_same(path, os.fstat(f.fileno()).st_ino)
                return check.ok
        except OSError as e:
            self._note_error("get", 1, e)
            return False

    def _read_verified(self, f: io.RawIOBase, key: bytes) -> PageCheck:
        """Reads the page into this thread's buffer and checks it; the L2 page is not
        touched, so a page that fails leaves nothing of itself in a cache."""
        header = bytearray(HEADER_BYTES)
        num_read = _read_into(f, memoryview(header))
        check = check_header(memoryview(header)[:num_read], self.namespace, key, self.page_bytes)
        if not check.ok:
            return check
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size != self._file_bytes:
            return PageCheck.SHORT
        payload = self._buffer().data
        num_read = _read_into(f, payload)
        return verify(header, payload[:num_read], self.namespace, key, self.page_bytes, self.mac)

    def _buffer(self) -> np.ndarray:
        buffer = getattr(self._buffers, "page", None)
        if buffer is None:
            buffer = self._buffers.page = np.empty(self.page_bytes, dtype=np.uint8)
        return buffer

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
        present = [self._present(key, "set") for key in keys]
        missing = [i for i, is_present in enumerate(present) if not is_present]
        written = self._each_page(
            self._write, [keys[i] for i in missing], [host_pages[i] for i in missing]
        )
        results = [True] * len(keys)
        for i, ok in zip(missing, written):
            results[i] = ok
        self._count_sets(sum(written), len(keys) - len(missing), start_s)
        return results

    def _write(self, key: bytes, page: torch.Tensor) -> bool:
        path = self.path_of(key)
        payload = page.numpy().data.cast("B")
        header = encode_header(self.namespace, key, payload, self.mac)
        temp_path = path.parent / f".{path.stem}.{uuid.uuid4().hex}.tmp"
        try:
            fd = self._create_exclusive(temp_path)
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

    def _create_exclusive(self, temp_path: Path) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(temp_path, flags, self._modes.file_mode)
        except FileNotFoundError:  # first page of this fan-out subdirectory
            try:
                temp_path.parent.mkdir(mode=self._modes.dir_mode)
                os.chmod(temp_path.parent, self._modes.dir_mode)  # whatever the umask
            except FileExistsError:
                pass  # another writer made it
            fd = os.open(temp_path, flags, self._modes.file_mode)
        if self._modes.file_mode & 0o077:
            try:
                os.fchmod(fd, self._modes.file_mode)  # group bits, whatever the umask
            except OSError:
                os.close(fd)
                _unlink_quietly(temp_path)
                raise
        return fd

    def _is_ours(self, path: str) -> bool:
        try:
            with open(os.open(path, _READ_FLAGS), "rb", buffering=0) as f:
                return header_namespace(f.read(HEADER_BYTES)) == self.namespace
        except OSError:
            return False


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
