"""KV block hashing (DESIGN.md "KV block hashing"): committed test vectors plus the chain's properties.

The router and every worker must agree on these digests byte for byte. The hex literals below are the
contract: they must NEVER change silently. If one of these tests fails, the hashing scheme changed —
bump ``HASH_VERSION`` (a new scheme gets a new version tag) and add new vectors; do not edit the old
ones to make the test pass.
"""

from __future__ import annotations

import struct
from hashlib import blake2b

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transfer.hashing import DIGEST_SIZE, HASH_VERSION, hash_block, hash_blocks, model_fingerprint, root_hash

FP = bytes(range(16))  # a fixed 16-byte model fingerprint for the chain vectors
TOKENS = list(range(10))  # two full blocks of 4 plus a partial block of 2

# ---- committed test vectors (never change silently) -----------------------------------------
# v2 (baton-kv-v2): the fingerprint covers the RoPE configuration.
FINGERPRINT_VECTOR = "470e07b291cd0c6dc440d05db5070a54"
ROOT_BS4 = "e015fe970eb5cdc06fdb5fa0cab8d776"
ROOT_BS16 = "97ba3437ae3a699d8874cb425a656d0c"
ROOT_BS4_SALT_A = "5be900b338839f160e96b0f4e836b5db"
BLOCK_1234 = "09e2d870c2aba8e1dff401ecce0befff"
BLOCK_EDGE_INTS = "ca9b6e9f77e39497d0dfc2354988caed"
CHAIN_BS4 = ["26ba51a40c48e5bb53459e8f2fe8e1da", "d630f396c68e0d9f4d042a97e1f3add0"]
CHAIN_BS4_SALT_A = ["04626b6a6141f102c59c821bf8c85354", "17ee93f250cee68ad1b7ec0b01ec6b2c"]
# v1 (baton-kv-v1, retired: its fingerprint left RoPE out), kept to show v2 is a new scheme, not an edit.
V1_ROOT_BS4 = "4bf6ee99eaceef533b1d6e72934e32dc"
V1_BLOCK_1234 = "01f2682221af9c7dbd0fd18526c6b5de"


def _fingerprint() -> bytes:
    return model_fingerprint(
        architecture="LlamaForCausalLM", hidden_size=64, num_layers=2, num_kv_heads=2, head_dim=16,
        dtype="float32", vocab_size=512, rope="default:10000.0", weights_id="tiny-v1",
    )


def test_version_tag_and_digest_size_are_the_v2_contract():
    assert HASH_VERSION == b"baton-kv-v2"
    assert DIGEST_SIZE == 16


def test_v1_vectors_are_the_v1_scheme_and_differ_from_v2():
    v1_root = _blake(b"baton-kv-v1", FP, (4).to_bytes(4, "little"))
    assert v1_root.hex() == V1_ROOT_BS4 != ROOT_BS4
    assert _blake(v1_root, struct.pack("<4i", 1, 2, 3, 4)).hex() == V1_BLOCK_1234 != BLOCK_1234


def test_model_fingerprint_vector():
    assert _fingerprint().hex() == FINGERPRINT_VECTOR


def test_root_hash_vectors():
    assert root_hash(FP, 4).hex() == ROOT_BS4
    assert root_hash(FP, 16).hex() == ROOT_BS16
    assert root_hash(FP, 4, "tenant-a").hex() == ROOT_BS4_SALT_A


def test_hash_block_vectors():
    root = root_hash(FP, 4)
    assert hash_block(root, [1, 2, 3, 4]).hex() == BLOCK_1234
    assert hash_block(root, [-1, 0, 2**31 - 1, 70000]).hex() == BLOCK_EDGE_INTS


def test_hash_blocks_vectors():
    assert [h.hex() for h in hash_blocks(TOKENS, 4, root_hash(FP, 4))] == CHAIN_BS4
    assert [h.hex() for h in hash_blocks(TOKENS, 4, root_hash(FP, 4, "tenant-a"))] == CHAIN_BS4_SALT_A


# ---- the scheme, rebuilt by hand ------------------------------------------------------------
def _blake(*parts: bytes) -> bytes:
    digest = blake2b(digest_size=16)
    for part in parts:
        digest.update(part)
    return digest.digest()


def test_root_hash_matches_hand_built_blake2b():
    expected = _blake(b"baton-kv-v2", FP, (4).to_bytes(4, "little"), b"tenant-a")
    assert root_hash(FP, 4, "tenant-a") == expected
    assert root_hash(FP, 4, b"tenant-a") == expected  # str and bytes salts agree


def test_block_tokens_are_packed_as_little_endian_int32():
    root = root_hash(FP, 4)
    tokens = [1, 256, -1, 2**31 - 1]
    packed = b"".join(t.to_bytes(4, "little", signed=True) for t in tokens)
    assert packed[:4] == b"\x01\x00\x00\x00" and packed[8:12] == b"\xff\xff\xff\xff"
    assert hash_block(root, tokens) == _blake(root, packed)
    big_endian = b"".join(t.to_bytes(4, "big", signed=True) for t in tokens)
    assert hash_block(root, tokens) != _blake(root, big_endian)


def test_token_outside_int32_is_rejected():
    with pytest.raises(struct.error):
        hash_block(root_hash(FP, 4), [2**31, 0, 0, 0])


def test_chain_is_hash_of_parent_and_block():
    root = root_hash(FP, 4)
    h0 = _blake(root, struct.pack("<4i", 0, 1, 2, 3))
    h1 = _blake(h0, struct.pack("<4i", 4, 5, 6, 7))
    assert hash_blocks(TOKENS, 4, root) == [h0, h1]


# ---- properties -----------------------------------------------------------------------------
def test_only_full_blocks_are_hashed():
    root = root_hash(FP, 4)
    assert hash_blocks([], 4, root) == []
    assert hash_blocks([1, 2, 3], 4, root) == []
    assert len(hash_blocks(list(range(8)), 4, root)) == 2
    assert hash_blocks(list(range(11)), 4, root) == hash_blocks(list(range(8)), 4, root)


def test_parent_is_required_when_start_is_positive():
    with pytest.raises(ValueError, match="parent"):
        hash_blocks(TOKENS, 4, root_hash(FP, 4), start=1)


def test_start_past_the_last_full_block_hashes_nothing():
    full = hash_blocks(TOKENS, 4, root_hash(FP, 4))
    assert hash_blocks(TOKENS, 4, root_hash(FP, 4), start=2, parent=full[-1]) == []


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=40),
    block_size=st.integers(min_value=1, max_value=8),
    data=st.data(),
)
def test_incremental_chain_equals_full_computation(tokens, block_size, data):
    root = root_hash(FP, block_size)
    full = hash_blocks(tokens, block_size, root)
    assert len(full) == len(tokens) // block_size
    start = data.draw(st.integers(min_value=0, max_value=len(full)))
    parent = full[start - 1] if start else None
    assert full[:start] + hash_blocks(tokens, block_size, root, start=start, parent=parent) == full


def test_different_cache_salt_gives_different_root_and_chain():
    roots = {salt: root_hash(FP, 4, salt) for salt in ("", "tenant-a", "tenant-b")}
    assert len(set(roots.values())) == 3
    chains = [hash_blocks(TOKENS, 4, root) for root in roots.values()]
    for i, chain in enumerate(chains):
        for other in chains[i + 1:]:
            assert not set(chain) & set(other)
    assert root_hash(FP, 4) == root_hash(FP, 4, "") == root_hash(FP, 4, b"")


def test_root_depends_on_fingerprint_and_block_size():
    assert root_hash(FP, 4) != root_hash(bytes(16), 4)
    assert root_hash(FP, 4) != root_hash(FP, 16)


def test_same_block_under_different_parents_differs():
    root = root_hash(FP, 4)
    h0, h1 = hash_blocks([9, 9, 9, 9, 9, 9, 9, 9], 4, root)
    assert h0 != h1  # identical tokens, different position in the chain


def test_model_fingerprint_depends_on_every_field():
    base = dict(architecture="LlamaForCausalLM", hidden_size=64, num_layers=2, num_kv_heads=2, head_dim=16,
                dtype="float32", vocab_size=512, rope="default:10000.0", weights_id="tiny-v1")
    changed = dict(architecture="Qwen2ForCausalLM", hidden_size=65, num_layers=3, num_kv_heads=1, head_dim=32,
                   dtype="bfloat16", vocab_size=513, rope="default:500000.0", weights_id="tiny-v2")
    fingerprints = {model_fingerprint(**base)}
    for key, value in changed.items():
        fingerprints.add(model_fingerprint(**{**base, key: value}))
    assert len(fingerprints) == 1 + len(changed)
    assert len(model_fingerprint(**base)) == 16
