"""An attacker's L3 pages (issue 27.4), built from the documented page layout with no
kvstrata code: version 1 with its unkeyed xxh3 checksum (what every rank accepted before
pages carried a MAC), or version 2 MACed with a key the attacker made up. The namespace
and page hashes are computable from the public weights and the tokens."""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

import xxhash

HEADER_BYTES = 128
FORGED_VERSIONS = (1, 2)


def forged_page(version: int, namespace: bytes, page_hash: bytes, payload: bytes) -> bytes:
    """Header + `payload` (someone else's KV) as page `page_hash` of `namespace`."""
    if version == 1:  # magic, version, xxh3, reserved, length, checksum, namespace, hash
        checksum = xxhash.xxh3_64_intdigest(payload)
        fields = struct.pack(
            "<4sHBBQQ32s32s", b"KVSP", 1, 2, 0, len(payload), checksum, namespace, page_hash
        )
        return fields + bytes(HEADER_BYTES - len(fields)) + payload
    # magic, version, HMAC-SHA256, reserved, length, namespace, hash, then the MAC
    fields = struct.pack("<4sHBBQ32s32s", b"KVSP", 2, 1, 0, len(payload), namespace, page_hash)
    mac = hmac.new(os.urandom(32), fields + payload, hashlib.sha256).digest()
    return fields + mac + bytes(HEADER_BYTES - len(fields) - len(mac)) + payload
