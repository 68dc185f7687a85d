"""Hash scheme v1: golden values, a scalar reference implementation, batch invariance."""

import numpy as np
import pytest
from hybridrec.pipeline import hashing

MASK = 2**64 - 1


def reference_splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def reference_hash(value: bytes) -> int:
    """The scheme exactly as documented in pipeline/hashing.py, one value at a time."""
    h = reference_splitmix64(len(value))
    for start in range(0, len(value), 8):
        word = int.from_bytes(value[start : start + 8].ljust(8, b"\0"), "little")
        h = reference_splitmix64(h ^ word)
    return h


def reference_id(value: bytes, prefix: int, prefix_bits: int = 8) -> int:
    if not value:
        return prefix << (64 - prefix_bits)
    low = reference_hash(value) >> prefix_bits or 1
    return (prefix << (64 - prefix_bits)) | low


GOLDEN = {
    b"": 0xE220A8397B1DCDAF,
    b"a": 0x5E025F9ADE9EAF3E,
    b"68fd1e64": 0xAFD2EA734B8E1A17,
    b"80e26c9b": 0x6ED3B0EBA90F9318,
    b"hello world, this is longer than 16 bytes": 0x8E25633485A9A8E1,
}


def test_golden_values_never_change():
    values = list(GOLDEN)
    assert [int(h) for h in hashing.hash_bytes_list(values)] == list(GOLDEN.values())


def test_matches_scalar_reference_for_all_lengths():
    rng = np.random.default_rng(0)
    values = [bytes(rng.integers(0, 256, n, dtype=np.uint8)) for n in range(0, 70)] * 2
    got = hashing.hash_bytes_list(values)
    assert [int(h) for h in got] == [reference_hash(v) for v in values]


def test_batch_composition_does_not_change_hashes():
    values = [f"value-{i}".encode() * (i % 5) for i in range(200)]
    together = hashing.hash_bytes_list(values)
    alone = np.concatenate([hashing.hash_bytes_list([v]) for v in values])
    reversed_batch = hashing.hash_bytes_list(values[::-1])[::-1]
    np.testing.assert_array_equal(together, alone)
    np.testing.assert_array_equal(together, reversed_batch)


@pytest.mark.parametrize("prefix_bits", [4, 8, 12])
def test_feature_ids_prefix_and_missing(prefix_bits):
    values = [b"", b"a", b"68fd1e64", b"x" * 33]
    raw = hashing.hash_bytes_list(values)
    missing = np.array([v == b"" for v in values])
    for prefix in (1, 7):
        ids = hashing.feature_ids(raw.copy(), missing, prefix, prefix_bits)
        assert [int(i) for i in ids] == [reference_id(v, prefix, prefix_bits) for v in values]
        assert all(int(i) >> (64 - prefix_bits) == prefix for i in ids)
        assert int(ids[0]) == hashing.missing_id(prefix, prefix_bits)
    # equal strings in different features never share an id
    assert not set(hashing.feature_ids(raw.copy(), missing, 1, 8)) & set(
        hashing.feature_ids(raw.copy(), missing, 2, 8)
    )
