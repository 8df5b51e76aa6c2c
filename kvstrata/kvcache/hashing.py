"""Page hashes: the namespace seed and the SHA-256 chain that names every full page of a
prefix, h_i = sha256(h_{i-1} || tokens_i as uint32 little-endian), h_{-1} = the seed."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

HASH_BYTES = 32  # SHA-256 digest size: every seed and page hash is this long
_NAMESPACE_TAG = b"kvstrata/namespace/v1"
_MAX_TOKEN_ID = 2**32 - 1


def namespace_seed(
    model_identity: str, page_size: int, kv_dtype: str, extra_key: str = ""
) -> bytes:
    """32 bytes that make the hashes of two models (or page sizes, KV dtypes, salts such as
    a LoRA id) disjoint, so they can share one L3 store without reading each other's pages.
    `kv_dtype` may be spelt "float16" or "torch.float16": both name the same namespace."""
    if page_size < 1:
        raise ValueError(f"page_size must be positive, got {page_size}")
    kv_dtype = kv_dtype.removeprefix("torch.")
    # Length-prefixed fields: no two different field tuples encode to the same bytes.
    digest = hashlib.sha256(_NAMESPACE_TAG)
    _update_field(digest, model_identity.encode())
    digest.update(struct.pack("<Q", page_size))
    _update_field(digest, kv_dtype.encode())
    _update_field(digest, extra_key.encode())
    return digest.digest()


def page_hashes(
    token_ids: Sequence[int], page_size: int, seed: bytes, prev_hash: bytes | None = None
) -> list[bytes]:
    """One chained hash per FULL page of `token_ids` (a trailing partial page has none).
    `prev_hash` continues a chain: the hash of the page just before `token_ids[0]`, so
    hashing a prefix and then its continuation equals hashing the whole at once."""
    if page_size < 1:
        raise ValueError(f"page_size must be positive, got {page_size}")
    prev = seed if prev_hash is None else prev_hash
    if len(prev) != HASH_BYTES:
        raise ValueError(f"a seed or previous hash is {HASH_BYTES} bytes, got {len(prev)}")
    num_pages = len(token_ids) // page_size
    if num_pages == 0:
        return []
    packed = _pack_tokens(token_ids[: num_pages * page_size])
    page_token_bytes = 4 * page_size
    hashes = []
    for start in range(0, num_pages * page_token_bytes, page_token_bytes):
        digest = hashlib.sha256(prev)
        digest.update(packed[start : start + page_token_bytes])
        prev = digest.digest()
        hashes.append(prev)
    return hashes


def hash_hex(page_hash: bytes) -> str:
    """The storage key of a page: its hash as 64 lowercase hex digits."""
    return page_hash.hex()


def _pack_tokens(token_ids: Sequence[int]) -> memoryview:
    """Token ids as little-endian uint32 bytes, in one numpy conversion (no per-token
    struct call). Ids outside [0, 2**32) are refused rather than silently wrapped."""
    ids = np.asarray(token_ids)
    if ids.dtype.kind not in "iu":
        ids = ids.astype(np.int64)  # e.g. an empty list or a list of Python ints > int64
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > _MAX_TOKEN_ID):
        raise ValueError("token ids must fit in an unsigned 32-bit integer")
    return np.ascontiguousarray(ids, dtype="<u4").data.cast("B")


def _update_field(digest: hashlib._Hash, field: bytes) -> None:
    digest.update(struct.pack("<Q", len(field)))
    digest.update(field)
