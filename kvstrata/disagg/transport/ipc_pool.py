"""The shared-memory file of a CPU `ipc` decode pool: a header (magic, owner id, generation,
shape, dtype) ahead of the pages, made by the decode rank, and the checked open a prefill
rank does before writing (a kvstrata name in /dev/shm, no link followed, nothing created)."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import stat
import struct
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstrata.disagg.transport.base import TransferError

logger = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
POOL_PREFIX = "kvstrata-kv-"  # then "<pid>-<12 hex digits>"
_POOL_NAME = re.compile(r"kvstrata-kv-[0-9]{1,10}-[0-9a-f]{12}")
_MAGIC = b"kvstrata-kvpool\x00"
_VERSION = 1
_MAX_DIMS = 8
# magic, version, owner id, generation, dtype index, ndim, dims (zero-padded)
_HEADER = struct.Struct(f"<16sI16sQII{_MAX_DIMS}Q")
HEADER_BYTES = 4096  # the pages start page-aligned after the header
# Indices are the header's: append only.
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
# What a caller is told when a pool is refused; the reason goes to this rank's log only
# (a caller must learn neither a pool's shape nor what exists in /dev/shm).
REFUSED = "the decode endpoint does not name a KV pool of a decode rank of this cluster"


@dataclass(frozen=True)
class PoolHeader:
    owner: str  # 32 hex digits, drawn by the decode rank that made the file
    generation: int  # when it made the file (ns): a recreated name is another pool
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def data_bytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize

    def pack(self) -> bytes:
        dims = list(self.shape) + [0] * (_MAX_DIMS - len(self.shape))
        return _HEADER.pack(
            _MAGIC,
            _VERSION,
            bytes.fromhex(self.owner),
            self.generation,
            DTYPES.index(self.dtype),
            len(self.shape),
            *dims,
        )

    @staticmethod
    def unpack(raw: bytes) -> PoolHeader:
        """Raises ValueError for anything but a header this version wrote."""
        if len(raw) < _HEADER.size:
            raise ValueError("short header")
        magic, version, owner, generation, dtype_index, ndim, *dims = _HEADER.unpack_from(raw)
        if magic != _MAGIC or version != _VERSION:
            raise ValueError("no kvstrata pool header")
        if not 0 <= dtype_index < len(DTYPES) or not 0 < ndim <= _MAX_DIMS:
            raise ValueError("bad dtype or rank in the header")
        return PoolHeader(owner.hex(), generation, tuple(dims[:ndim]), DTYPES[dtype_index])


def shared_pool_data(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Path]:
    """A zeroed CPU tensor backed by a new file in /dev/shm (mode 0600, made exclusively,
    with its header first). The file is unlinked when the tensor is collected or the
    process exits (mappings made by peers stay valid); pools left by processes that died
    without that (SIGKILL) are removed first."""
    remove_stale_pools()
    path = SHM_DIR / f"{POOL_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    header = PoolHeader(secrets.token_hex(16), time.time_ns(), tuple(shape), dtype)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        os.ftruncate(fd, HEADER_BYTES + header.data_bytes)  # zero-filled
        os.pwrite(fd, header.pack(), 0)
        data = _map(fd, header)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    weakref.finalize(data, _unlink_quietly, path)
    return data, path


def read_own_header(path: Path) -> PoolHeader:
    """The header of a pool file this process made."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return PoolHeader.unpack(os.pread(fd, _HEADER.size, 0))
    finally:
        os.close(fd)


def open_pool(shm_path: str, expected: PoolHeader) -> torch.Tensor:
    """Map the pool a decode rank of this host registered as `expected`. Refused
    (TransferError(REFUSED)) unless `shm_path` is a kvstrata pool name in /dev/shm naming
    a regular file of this user with one link, not a symlink, of the right size, whose
    header matches `expected` field by field. Opens with O_NOFOLLOW and never creates."""
    try:
        return _open_checked(shm_path, expected)
    except (OSError, ValueError) as e:
        logger.warning("refused ipc pool %r: %s", shm_path[:300], e)
        raise TransferError(REFUSED) from None


def _open_checked(shm_path: str, expected: PoolHeader) -> torch.Tensor:
    path = Path(shm_path)
    if path.parent != SHM_DIR or not _POOL_NAME.fullmatch(path.name):
        raise ValueError("not a kvstrata pool name in /dev/shm")
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            raise ValueError("not a regular file with a single link")
        if info.st_uid != os.geteuid():
            raise ValueError(f"owned by uid {info.st_uid}, not this user")
        if info.st_size != HEADER_BYTES + expected.data_bytes:
            raise ValueError(f"{info.st_size} bytes, not the registered pool's")
        if PoolHeader.unpack(os.pread(fd, _HEADER.size, 0)) != expected:
            raise ValueError("its header differs from the endpoint's")
        return _map(fd, expected)
    finally:
        os.close(fd)


def _map(fd: int, header: PoolHeader) -> torch.Tensor:
    # The tensor keeps the mapping alive (and the mapping outlives the closed fd).
    mapping = mmap.mmap(fd, HEADER_BYTES + header.data_bytes)
    numel = header.data_bytes // header.dtype.itemsize
    flat = torch.frombuffer(mapping, dtype=header.dtype, count=numel, offset=HEADER_BYTES)
    return flat.view(header.shape)


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):  # gone already, or another user's in sticky /dev/shm
        path.unlink(missing_ok=True)


def remove_stale_pools() -> list[Path]:
    """Unlink the pool files of processes that no longer exist; returns them. A peer that
    still maps one keeps its mapping (unlinking only drops the name)."""
    removed = []
    for path in SHM_DIR.glob(f"{POOL_PREFIX}*"):
        pid_text = path.name[len(POOL_PREFIX) :].split("-", 1)[0]
        if pid_text.isdigit() and not process_exists(int(pid_text)):
            _unlink_quietly(path)
            removed.append(path)
    return removed


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
