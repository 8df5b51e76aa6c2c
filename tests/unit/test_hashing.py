"""Exact tests of the page hash chain and the namespace seed (kvcache/hashing.py): expected
values are computed here independently with hashlib and struct."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.kvcache.hashing import hash_hex, namespace_seed, page_hashes

SEED = hashlib.sha256(b"test seed").digest()


def reference_chain(token_ids: list[int], page_size: int, prev: bytes) -> list[bytes]:
    """DESIGN section 1, literally: h_i = sha256(h_{i-1} || tokens_i as <u32)."""
    hashes = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = token_ids[start : start + page_size]
        prev = hashlib.sha256(prev + b"".join(struct.pack("<I", t) for t in page)).digest()
        hashes.append(prev)
    return hashes


def test_known_input_gives_exact_hashes() -> None:
    tokens = [1, 2, 3, 4, 70000, 2**32 - 1, 7]  # 3 full pages of 2, one partial token
    h0 = hashlib.sha256(SEED + bytes.fromhex("0100000002000000")).digest()
    h1 = hashlib.sha256(h0 + bytes.fromhex("0300000004000000")).digest()
    h2 = hashlib.sha256(h1 + bytes.fromhex("70110100ffffffff")).digest()
    assert page_hashes(tokens, 2, SEED) == [h0, h1, h2]


def test_partial_page_has_no_hash_and_empty_input_has_none() -> None:
    assert page_hashes([5, 6, 7], 4, SEED) == []
    assert page_hashes([], 4, SEED) == []
    assert len(page_hashes(list(range(11)), 4, SEED)) == 2


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    page_size=st.integers(1, 5),
    split_pages=st.integers(0, 10),
)
def test_chain_matches_reference_and_continuation_equals_one_shot(
    tokens: list[int], page_size: int, split_pages: int
) -> None:
    whole = page_hashes(tokens, page_size, SEED)
    assert whole == reference_chain(tokens, page_size, SEED)
    split = min(split_pages, len(whole)) * page_size
    head = page_hashes(tokens[:split], page_size, SEED)
    prev = head[-1] if head else None
    assert head + page_hashes(tokens[split:], page_size, SEED, prev_hash=prev) == whole


def test_numpy_and_list_inputs_hash_alike() -> None:
    tokens = list(range(100, 164))
    expected = page_hashes(tokens, 16, SEED)
    assert page_hashes(np.array(tokens, dtype=np.int64), 16, SEED) == expected
    assert page_hashes(np.array(tokens, dtype=np.uint32), 16, SEED) == expected


def test_one_token_changes_its_page_and_every_later_hash() -> None:
    tokens = list(range(16))
    changed = [*tokens[:5], 999, *tokens[6:]]
    a, b = page_hashes(tokens, 4, SEED), page_hashes(changed, 4, SEED)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:]))


def test_invalid_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        page_hashes([1, 2], 0, SEED)
    with pytest.raises(ValueError):
        page_hashes([1, 2], 2, b"short")
    with pytest.raises(ValueError):
        page_hashes([-1, 2], 2, SEED)
    with pytest.raises(ValueError):
        page_hashes([2**32, 2], 2, SEED)


def test_namespace_seed_is_exact_and_every_field_changes_every_hash() -> None:
    def field(data: bytes) -> bytes:
        return struct.pack("<Q", len(data)) + data

    expected = hashlib.sha256(
        b"kvstrata/namespace/v1"
        + field(b"model-a")
        + struct.pack("<Q", 16)
        + field(b"float16")
        + field(b"")
    ).digest()
    base = namespace_seed("model-a", 16, "float16")
    assert base == expected and len(base) == 32
    assert namespace_seed("model-a", 16, "torch.float16") == base  # str(torch.float16)
    variants = [
        namespace_seed("model-b", 16, "float16"),
        namespace_seed("model-a", 32, "float16"),
        namespace_seed("model-a", 16, "bfloat16"),
        namespace_seed("model-a", 16, "float16", extra_key="lora-7"),
    ]
    assert len({base, *variants}) == 5
    tokens = list(range(64))
    base_hashes = set(page_hashes(tokens, 16, base))
    for seed in variants:
        assert base_hashes.isdisjoint(page_hashes(tokens, 16, seed))
    # Field boundaries are unambiguous: moving a character between fields changes the seed.
    assert namespace_seed("ab", 1, "c") != namespace_seed("a", 1, "bc")


def test_hash_hex_is_the_lowercase_digest() -> None:
    h = page_hashes([1, 2], 2, SEED)[0]
    assert hash_hex(h) == h.hex() and len(hash_hex(h)) == 64
