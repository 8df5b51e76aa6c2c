"""The on-storage form of one L3 page, shared by every backend: a fixed header (magic,
version, namespace seed, page hash, payload length, a keyed MAC of all of it and the
payload) + the payload. `PageMac` computes the MAC; only holders of its key can make one."""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct

from kvstrata.kvcache.hashing import HASH_BYTES

MAGIC = b"KVSP"
# 2: a keyed MAC replaces version 1's unkeyed checksum (crc32 / xxh3), which anyone who
# knew the format could recompute over KV of their own. Version 1 pages are misses.
VERSION = 2
MAC_HMAC_SHA256 = 1  # the only MAC so far; the byte lets a faster one be added later
MAC_BYTES = 32
HEADER_BYTES = 128  # fixed; padding keeps the payload 64-byte aligned inside a blob
_KEY_ID_LABEL = b"kvstrata l3 key id v1"

# magic, version, MAC algorithm, reserved, payload bytes, namespace, page hash, MAC.
_LAYOUT = struct.Struct(f"<4sHBBQ{HASH_BYTES}s{HASH_BYTES}s{MAC_BYTES}s")
_MAC_OFFSET = _LAYOUT.size - MAC_BYTES  # the MAC covers the header bytes before it
_PADDING = bytes(HEADER_BYTES - _LAYOUT.size)


class PageCheck(enum.Enum):
    """Why a stored page is (not) usable. Anything but OK is a miss."""

    OK = "ok"
    SHORT = "short"  # fewer bytes than header + payload: truncated or partial
    BAD_MAGIC = "bad_magic"  # not a kvstrata page, or another format version
    FOREIGN_NAMESPACE = "foreign_namespace"  # another model / page size / dtype / salt
    WRONG_HASH = "wrong_hash"  # a page stored under another page's key
    WRONG_LENGTH = "wrong_length"  # payload length differs from this pool's page_bytes
    # Written without this rank's L3 key (forged, or by a rank with another key), or
    # header or payload bytes changed after they were written.
    BAD_MAC = "bad_mac"

    @property
    def ok(self) -> bool:
        return self is PageCheck.OK


class PageMac:
    """HMAC-SHA256 under one key of a page's header fields and payload. Thread-safe: each
    tag starts from a copy of the keyed state. hashlib releases the GIL while it hashes,
    so I/O threads tag pages in parallel. The key never leaves this object."""

    algorithm = MAC_HMAC_SHA256

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError(f"an L3 page MAC key has at least 16 bytes, got {len(key)}")
        self._keyed = hmac.new(key, digestmod=hashlib.sha256)
        # A fingerprint that says whether two ranks share a key, and nothing of the key.
        self.key_id = hmac.new(key, _KEY_ID_LABEL, hashlib.sha256).hexdigest()[:16]

    def tag(
        self, header_fields: memoryview | bytes, payload: memoryview | bytes | bytearray
    ) -> bytes:
        mac = self._keyed.copy()
        mac.update(header_fields)
        mac.update(payload)
        return mac.digest()

    def __repr__(self) -> str:
        return f"PageMac(key_id={self.key_id})"


def encode_header(
    namespace: bytes, page_hash: bytes, payload: memoryview | bytes, mac: PageMac
) -> bytes:
    """The HEADER_BYTES that precede `payload` on storage; MACs `payload` now, so the
    caller must not change it until it has been written."""
    if len(namespace) != HASH_BYTES or len(page_hash) != HASH_BYTES:
        raise ValueError(f"namespace and page hash must be {HASH_BYTES} bytes each")
    fields = _LAYOUT.pack(
        MAGIC, VERSION, mac.algorithm, 0, len(payload), namespace, page_hash, bytes(MAC_BYTES)
    )[:_MAC_OFFSET]
    return fields + mac.tag(fields, payload) + _PADDING


def check_header(
    header: memoryview | bytes | bytearray, namespace: bytes, page_hash: bytes, page_bytes: int
) -> PageCheck:
    """Everything but the MAC: lets a reader give up before reading a payload. Nothing it
    accepts is trusted until `verify` has checked the MAC."""
    if len(header) < HEADER_BYTES:
        return PageCheck.SHORT
    magic, version, algorithm, _, payload_bytes, stored_ns, stored_hash, _ = _LAYOUT.unpack_from(
        header
    )
    if magic != MAGIC or version != VERSION or algorithm != MAC_HMAC_SHA256:
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
    mac: PageMac,
) -> PageCheck:
    """Whether `header` + `payload` is page `page_hash` of `namespace` as a holder of
    `mac`'s key wrote it. The caller must not let `payload` reach a cache before OK."""
    result = check_header(header, namespace, page_hash, page_bytes)
    if not result.ok:
        return result
    if len(payload) != page_bytes:
        return PageCheck.SHORT
    header = memoryview(header)
    expected = mac.tag(header[:_MAC_OFFSET], payload)
    if not hmac.compare_digest(expected, header[_MAC_OFFSET : _LAYOUT.size]):
        return PageCheck.BAD_MAC
    return PageCheck.OK


def header_namespace(header: memoryview | bytes | bytearray) -> bytes | None:
    """The namespace a stored header names, or None if it is not a kvstrata page header
    of this format version. Unauthenticated: fit only to pick pages for removal."""
    if len(header) < HEADER_BYTES:
        return None
    fields = _LAYOUT.unpack_from(header)
    if fields[0] != MAGIC or fields[1] != VERSION:
        return None
    return fields[5]
