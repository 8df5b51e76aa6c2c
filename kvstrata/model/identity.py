"""`model_identity`: a fingerprint of a checkpoint's contents (config.json and every byte of
its safetensors or GGUF files), so that only identical weights share an L3 namespace. Each
file's xxh3_128 is computed once and kept in a sidecar keyed by the file's name and stamp."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import xxhash

from kvstrata.model.gguf_dir import resolve_model_dir
from kvstrata.model.loader import checkpoint_files

logger = logging.getLogger("kvstrata.model")

SIDECAR_NAME = ".kvstrata-identity.json"
_LOCK_SUFFIX = ".lock"
_SIDECAR_VERSION = 1
_IDENTITY_TAG = b"kvstrata/model-identity/v2"  # v1 hashed file sizes, not contents
_READ_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class FileStamp:
    """What must be unchanged for a cached content hash to still hold. ctime is kept
    besides mtime because no ordinary write can leave it unchanged (`touch -d` and
    `cp -p` can restore an mtime, not a ctime); a false miss only costs one re-hash."""

    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        st = path.stat()  # follows symlinks: a Hugging Face snapshot links to blobs
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def model_identity(model_dir: str | Path) -> str:
    """Hex SHA-256 over config.json's bytes and, per safetensors file (by name), its size
    and xxh3_128 content hash. Any two checkpoints that differ in a tensor (or its
    header) differ here. A file is read in full the first time only; later starts reuse
    the sidecar entry while the file's stamp is unchanged. A .gguf file is hashed as the
    weights of its model directory."""
    model_dir = resolve_model_dir(model_dir)
    files = checkpoint_files(model_dir)
    content_hashes = _content_hashes(model_dir, files)
    digest = hashlib.sha256(_IDENTITY_TAG)
    _update_field(digest, (model_dir / "config.json").read_bytes())
    for path in files:
        _update_field(digest, path.name.encode())
        digest.update(struct.pack("<Q", path.stat().st_size))
        _update_field(digest, bytes.fromhex(content_hashes[path.name]))
    return digest.hexdigest()


def file_content_hash(path: Path) -> str:
    """xxh3_128 of the whole file, hex (read in large chunks into one reused buffer)."""
    hasher = xxhash.xxh3_128()
    buffer = bytearray(_READ_CHUNK_BYTES)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        with contextlib.suppress(AttributeError, OSError):  # advice only
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while num_read := f.readinto(buffer):
            hasher.update(view[:num_read])
    return hasher.hexdigest()


def sidecar_paths(model_dir: Path) -> list[Path]:
    """Where the cache of `model_dir` may live, in order of preference: beside the weights,
    then under the user's cache dir (for a read-only model dir), named by its real path."""
    real = str(model_dir.resolve())
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    name = hashlib.sha256(real.encode()).hexdigest()[:32] + ".json"
    return [model_dir / SIDECAR_NAME, base / "kvstrata" / "identity" / name]


def _content_hashes(model_dir: Path, files: list[Path]) -> dict[str, str]:
    stamps = {path.name: FileStamp.of(path) for path in files}
    candidates = sidecar_paths(model_dir)
    cached: dict[str, str] = {}
    for sidecar in candidates:
        cached = _valid_entries(sidecar, stamps) | cached
    if len(cached) == len(files):
        return cached
    for sidecar in candidates:
        with _locked(sidecar) as locked:
            if not locked:
                continue  # this place is not writable: try the next
            # Another rank may have hashed the files while this one waited for the lock.
            cached = _valid_entries(sidecar, stamps) | cached
            fresh = _hash_missing(files, stamps, cached)
            _write_sidecar(sidecar, stamps, cached | fresh)
            return cached | fresh
    logger.warning(
        "no writable place for %s (tried %s): the checkpoint is hashed in full at every start",
        SIDECAR_NAME,
        ", ".join(str(p) for p in candidates),
    )
    return cached | _hash_missing(files, stamps, cached)


def _hash_missing(
    files: list[Path], stamps: dict[str, FileStamp], cached: dict[str, str]
) -> dict[str, str]:
    fresh: dict[str, str] = {}
    for path in files:
        if path.name in cached:
            continue
        logger.info("hashing %s (%.2f GB) for the L3 namespace", path, path.stat().st_size / 1e9)
        fresh[path.name] = file_content_hash(path)
        if FileStamp.of(path) != stamps[path.name]:
            # Written to while being read: the hash names no stable content. Refuse to
            # start rather than share pages under a namespace nothing else can match.
            raise ValueError(f"checkpoint file {path} changed while it was being hashed")
    return fresh


def _valid_entries(sidecar: Path, stamps: dict[str, FileStamp]) -> dict[str, str]:
    """The sidecar's hashes whose stamps still match the files; nothing if unreadable."""
    try:
        body = json.loads(sidecar.read_text())
        if body.get("version") != _SIDECAR_VERSION:
            return {}
        entries = body["files"]
        valid = {}
        for name, stamp in stamps.items():
            entry = entries.get(name)
            if isinstance(entry, dict) and _stamp_of(entry) == stamp:
                valid[name] = str(entry["xxh3_128"])
        return valid
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # missing, torn or foreign: hash again


def _stamp_of(entry: dict) -> FileStamp | None:
    try:
        return FileStamp(
            int(entry["size"]), int(entry["mtime_ns"]), int(entry["ctime_ns"]), int(entry["inode"])
        )
    except (KeyError, TypeError, ValueError):
        return None


def _write_sidecar(sidecar: Path, stamps: dict[str, FileStamp], hashes: dict[str, str]) -> None:
    files = {name: asdict(stamps[name]) | {"xxh3_128": hashes[name]} for name in sorted(stamps)}
    text = json.dumps({"version": _SIDECAR_VERSION, "files": files}, indent=1)
    try:
        # Temp file + rename: a reader sees the old sidecar or the new one, never half.
        fd, tmp = tempfile.mkstemp(dir=sidecar.parent, prefix=sidecar.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, sidecar)
    except OSError as e:
        logger.warning("cannot write %s: %s (the next start hashes again)", sidecar, e)


@contextlib.contextmanager
def _locked(sidecar: Path) -> Iterator[bool]:
    """Hold an exclusive lock on `sidecar`'s lock file (ranks of one launch start at once:
    one hashes, the others wait and read its result). Yields False if it cannot be made."""
    try:
        sidecar.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(sidecar.with_name(sidecar.name + _LOCK_SUFFIX), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # closing releases the lock


def _update_field(digest: hashlib._Hash, field: bytes) -> None:
    digest.update(struct.pack("<Q", len(field)))
    digest.update(field)
