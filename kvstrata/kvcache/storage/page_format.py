"""The on-storage form of one L3 page, shared by every backend: a fixed header (magic,
version, namespace seed, page hash, payload length, content checksum) + the payload."""

from __future__ import annotations

import enum
import struct
import zlib

import xxhash

from kvstrata.kvcache.hashing import HASH_BYTES

MAGIC = b"KVSP"
VERSION = 1
CHECKSUM_CRC32 = 1  # zlib.crc32: 1-7 GB/s depending on the CPU (read back, never written)
CHECKSUM_XXH3 = 2  # xxh3_64: several times faster, so a page read is I/O-bound
_CHECKSUMS = {
    CHECKSUM_CRC32: zlib.crc32,
    CHECKSUM_XXH3: xxhash.xxh3_64_intdigest,
}
HEADER_BYTES = 128  # fixed; padding keeps the payload 64-byte aligned inside a blob

# magic, version, checksum algorithm, reserved, payload bytes, checksum, namespace, hash.
_LAYOUT = struct.Struct(f"<4sHBBQQ{HASH_BYTES}s{HASH_BYTES}s")
_PADDING = bytes(HEADER_BYTES - _LAYOUT.size)


class PageCheck(enum.Enum):
    """Why a stored page is (not) usable. Anything but OK is a miss."""

    OK = "ok"
    SHORT = "short"  # fewer bytes than header + payload: truncated or partial
    BAD_MAGIC = "bad_magic"  # not a kvstrata page, or an unknown format version
    FOREIGN_NAMESPACE = "foreign_namespace"  # another model / page size / dtype / salt
    WRONG_HASH = "wrong_hash"  # a page stored under another page's key
    WRONG_LENGTH = "wrong_length"  # payload length differs from this pool's page_bytes
    BAD_CHECKSUM = "bad_checksum"  # payload bytes changed after they were written

    @property
    def ok(self) -> bool:
        return self is PageCheck.OK


def checksum(payload: memoryview | bytes | bytearray, algorithm: int = CHECKSUM_XXH3) -> int:
    return _CHECKSUMS[algorithm](payload)


def encode_header(namespace: bytes, page_hash: bytes, payload: memoryview | bytes) -> bytes:
    """The HEADER_BYTES that precede `payload` on storage; checksums `payload` now, so the
    caller must not change it until it has been written."""
    if len(namespace) != HASH_BYTES or len(page_hash) != HASH_BYTES:
        raise ValueError(f"namespace and page hash must be {HASH_BYTES} bytes each")
    fields = _LAYOUT.pack(
        MAGIC, VERSION, CHECKSUM_XXH3, 0, len(payload), checksum(payload), namespace, page_hash
    )
    return fields + _PADDING


def check_header(
    header: memoryview | bytes | bytearray, namespace: bytes, page_hash: bytes, page_bytes: int
) -> PageCheck:
    """Everything but the payload checksum: lets a reader give up before reading a payload."""
    if len(header) < HEADER_BYTES:
        return PageCheck.SHORT
    magic, version, algorithm, _, payload_bytes, _, stored_ns, stored_hash = _LAYOUT.unpack_from(
        header
    )
    if magic != MAGIC or version != VERSION or algorithm not in _CHECKSUMS:
        return PageCheck.BAD_MAGIC
    if bytes(header[_LAYOUT.size : HEADER_BYTES]) != _PADDING:
        return PageCheck.BAD_MAGIC
    if stored_ns != namespace:
        return PageCheck.FOREIGN_NAMESPACE
    if stored_hash != page_hash:
        return PageCheck.WRONG_HASH
    if payload_bytes != page_bytes:
        return PageCheck.WRONG_LENGTH
    return PageCheck.OK


def verify(
    header: memoryview | bytes | bytearray,
    payload: memoryview | bytes | bytearray,
    namespace: bytes,
    page_hash: bytes,
    page_bytes: int,
) -> PageCheck:
    """Whether `header` + `payload` is intact page `page_hash` of `namespace`."""
    result = check_header(header, namespace, page_hash, page_bytes)
    if not result.ok:
        return result
    if len(payload) != page_bytes:
        return PageCheck.SHORT
    fields = _LAYOUT.unpack_from(header)
    algorithm, stored_checksum = fields[2], fields[5]
    if checksum(payload, algorithm) != stored_checksum:
        return PageCheck.BAD_CHECKSUM
    return PageCheck.OK


def header_namespace(header: memoryview | bytes | bytearray) -> bytes | None:
    """The namespace a stored header names, or None if it is not a kvstrata page header."""
    if len(header) < HEADER_BYTES:
        return None
    fields = _LAYOUT.unpack_from(header)
    if fields[0] != MAGIC or fields[1] != VERSION:
        return None
    return fields[6]
