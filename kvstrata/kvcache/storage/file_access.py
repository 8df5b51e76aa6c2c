"""Access rules of the `file` backend's directory: `prepare_directory` (create it private,
refuse one another user owns or may write, unless shared directories are allowed) and
`directory_key` (the directory's own MAC key file, made on first use, 0600 like the pages)."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import uuid
from pathlib import Path

from kvstrata.config.options import ConfigError
from kvstrata.kvcache.storage.trust import L3Trust, mac_key_from_secret

log = logging.getLogger("kvstrata.kvcache.storage")

KEY_FILE_NAME = "kvstrata-l3.key"  # matches no page, temp or fan-out name: clear() keeps it
SHARED_DIR_FLAG = "--hicache-storage-allow-shared-dir"
KEY_FILE_FLAG = "--hicache-storage-key-file"
_SUBDIR_CHARS = frozenset("0123456789abcdef")


def prepare_directory(directory: Path, trust: L3Trust) -> bool:
    """Makes `directory` (and missing parents) with the trust's dir mode, or checks the one
    there: owned by this user (or, in group mode, by the directory's group) and writable
    by nobody else, and so are its fan-out subdirectories. A directory of this user's
    with looser read bits (made by an older kvstrata: 0755) is tightened. Raises
    ConfigError naming --hicache-storage-allow-shared-dir for one that fails, unless that
    flag is set. False: no directory (cannot be made); sets will fail, counted."""
    modes = trust.modes
    try:
        directory.mkdir(parents=True, mode=modes.dir_mode)
        os.chmod(directory, modes.dir_mode)  # the umask may have cleared group bits
        return True
    except FileExistsError:
        pass
    except OSError as e:
        log.warning("file storage: cannot create %s: %s", directory, e)
        return False
    try:
        st = os.stat(directory)  # a link to a directory is judged by the directory
        if not stat.S_ISDIR(st.st_mode):
            log.warning("file storage: %s is not a directory", directory)
            return False
        _check_dir(directory, st, trust)
        for entry in os.scandir(directory):
            if len(entry.name) == 2 and set(entry.name) <= _SUBDIR_CHARS:
                # Not followed: a link here could send pages anywhere.
                _check_dir(Path(entry.path), entry.stat(follow_symlinks=False), trust)
    except OSError as e:  # unreadable: sets fail, counted
        log.warning("file storage: cannot use %s: %s", directory, e)
        return False
    return True


def _check_dir(path: Path, st: os.stat_result, trust: L3Trust) -> None:
    modes = trust.modes
    problem = None
    if not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory (a link?)"
    elif not _owned_by_us(st, trust):
        problem = f"is owned by uid {st.st_uid}, not this process's uid {os.geteuid()}"
    elif st.st_mode & (stat.S_IWOTH | (0 if modes.group_shares else stat.S_IWGRP)):
        problem = f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    if problem is not None:
        if not trust.allow_shared_dir:
            raise ConfigError(
                f"--hicache-storage-dir: {path} {problem}: another user could read, replace "
                f"or plant L3 pages and keys there. Use a directory of your own (it is made "
                f"mode {modes.dir_mode:04o}; --hicache-storage-file-mode group for one a "
                f"group shares), or give {SHARED_DIR_FLAG} to use it anyway"
            )
        log.warning(
            "file storage: %s %s; used anyway (%s): pages are trusted only through their MAC, "
            "and others may delete them",
            path,
            problem,
            SHARED_DIR_FLAG,
        )
        return
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != modes.dir_mode:
        log.info(
            "file storage: %s had mode %04o; now %04o",
            path,
            stat.S_IMODE(st.st_mode),
            modes.dir_mode,
        )
        os.chmod(path, modes.dir_mode)


def _owned_by_us(st: os.stat_result, trust: L3Trust) -> bool:
    if st.st_uid == os.geteuid():
        return True
    return trust.modes.group_shares and st.st_gid in {os.getegid(), *os.getgroups()}


def directory_key(directory: Path, trust: L3Trust) -> bytes | None:
    """The MAC key of the directory's key file, made (random, the trust's file mode) if
    there is none, so every process of this user on this directory shares pages. None if
    it cannot be made (a read-only or missing directory). Raises ConfigError for a key
    file another user owns or could read or write: a key others know signs nothing."""
    path = directory / KEY_FILE_NAME
    try:
        return _read_key(path, trust)
    except FileNotFoundError:
        pass
    try:
        if _create_key(path, trust):
            log.info("file storage: made the L3 page key %s", path)
        # else another process made it between our read and our create: read theirs
        return _read_key(path, trust)
    except OSError as e:  # ConfigError is no OSError: a bad key file still refuses
        log.warning("file storage: cannot make the L3 page key %s: %s", path, e)
        return None


def _read_key(path: Path, trust: L3Trust) -> bytes:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as e:  # a link (ELOOP), unreadable, ...
        raise _bad_key(path, f"cannot be read ({e})") from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        loose = stat.S_IRWXO | (stat.S_IWGRP if trust.modes.group_shares else stat.S_IRWXG)
        if not stat.S_ISREG(st.st_mode):
            raise _bad_key(path, "is not a regular file")
        if not _owned_by_us(st, trust):
            raise _bad_key(path, f"is owned by uid {st.st_uid}")
        if st.st_mode & loose:
            raise _bad_key(path, f"is open to other users (mode {stat.S_IMODE(st.st_mode):04o})")
        secret = f.read(4096).decode("ascii", errors="replace").strip()
    if len(secret) < 32:
        raise _bad_key(path, "holds no key")
    return mac_key_from_secret(secret)


def _create_key(path: Path, trust: L3Trust) -> bool:
    """Writes a fresh key beside `path`, then links it in: a reader sees a whole key or
    none, and of two processes creating it at once exactly one wins. False: it lost."""
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, trust.modes.file_mode)
    try:
        try:
            os.fchmod(fd, trust.modes.file_mode)  # exact, whatever the umask
            os.write(fd, (secrets.token_hex(32) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.link(temp, path)
        return True
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp)


def _bad_key(path: Path, problem: str) -> ConfigError:
    return ConfigError(
        f"--hicache-storage-dir: the L3 page key {path} {problem}. Remove it (a new one is "
        f"made; pages signed with the old one become misses) or give {KEY_FILE_FLAG}"
    )
