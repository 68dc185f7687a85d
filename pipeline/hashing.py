"""Stable 64-bit ids for categorical values, computed on whole columns with numpy.

Hash scheme `hybridrec-wordmix64`, version 1 (recorded in metadata.json):

    h = splitmix64(len(value))
    for each 8-byte little-endian word w of the value (last word zero padded):
        h = splitmix64(h ^ w)
    low = h >> prefix_bits;  low = 1 if low == 0
    id = (prefix << (64 - prefix_bits)) | low          prefix = 1 + feature index in the spec
    missing value (empty field): id = prefix << (64 - prefix_bits)   (low bits all zero)

`splitmix64(z)` is the finalizer of Steele et al.'s SplitMix64 generator with the
golden-gamma increment, all arithmetic modulo 2**64. Nothing depends on the
platform, the Python process (unlike `hash()`), the runner or the batch size, so
an input row gets the same ids everywhere. Equal strings in different features
get different ids because the prefixes differ, and a feature's missing id never
collides with one of its values.
"""

from __future__ import annotations

import numpy as np

HASH_SCHEME_NAME = "hybridrec-wordmix64"
HASH_SCHEME_VERSION = 1

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def hash_scheme(prefix_bits: int) -> dict:
    return {"name": HASH_SCHEME_NAME, "version": HASH_SCHEME_VERSION, "prefix_bits": prefix_bits}


def splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer of `values` (uint64, any shape), wrapping modulo 2**64."""
    z = values.astype(np.uint64, copy=True)
    z += _GOLDEN
    z ^= z >> _S30
    z *= _MIX1
    z ^= z >> _S27
    z *= _MIX2
    z ^= z >> _S31
    return z


def padded_words(buffer: np.ndarray) -> np.ndarray:
    """A view of every (unaligned) little-endian 8-byte word of `buffer`.

    Args:
        buffer: uint8 [n] bytes; the result indexes words starting at any byte.

    Returns:
        uint64 [n] where element i is bytes i..i+7 (zero padded past the end).
    """
    padded = np.concatenate([buffer, np.zeros(8, np.uint8)])
    return np.ndarray(shape=(len(buffer) + 1,), dtype="<u8", buffer=padded, strides=(1,))


def hash_fields(words: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Raw 64-bit hashes of byte strings given as (start, length) into one buffer.

    Args:
        words: `padded_words(buffer)` of the buffer holding the strings.
        starts: int64 [...] byte offset of each string.
        lengths: int64 [...] byte length of each string (same shape).

    Returns:
        uint64 [...] hashes (the `h` of the module docstring).
    """
    lengths = lengths.astype(np.int64, copy=False)
    if lengths.size == 0:
        return np.zeros(lengths.shape, np.uint64)
    max_length = int(lengths.max())
    if max_length < 4096:  # the usual case: look the length hash up instead of mixing
        h = splitmix64(np.arange(max_length + 1, dtype=np.uint64))[lengths]
    else:
        h = splitmix64(lengths.astype(np.uint64))
    max_words = (max_length + 7) // 8
    for k in range(max_words):
        remaining = lengths - 8 * k
        active = remaining > 0
        # inactive positions read a harmless word; their result is discarded below
        word = words[np.minimum(starts + 8 * k, len(words) - 1)]
        partial = active & (remaining < 8)
        if partial.any():
            shift = (np.clip(remaining, 0, 8) * 8).astype(np.uint64)
            mask = np.where(
                partial, (np.uint64(1) << (shift & np.uint64(63))) - np.uint64(1), ~np.uint64(0)
            )
            word &= mask
        mixed = splitmix64(h ^ word)
        h = mixed if active.all() else np.where(active, mixed, h)
    return h


def hash_bytes_list(values: list[bytes]) -> np.ndarray:
    """Raw hashes of a list of byte strings (convenience for tests and small inputs)."""
    buffer = np.frombuffer(b"".join(values), np.uint8)
    lengths = np.array([len(v) for v in values], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return hash_fields(padded_words(buffer), starts, lengths)


def feature_ids(raw_hashes: np.ndarray, missing: np.ndarray, prefix: int, prefix_bits: int):
    """Turns raw hashes into ids of one feature: prefix in the high bits, missing id.

    Args:
        raw_hashes: uint64 [...] from `hash_fields`.
        missing: bool [...] true where the field was empty.
        prefix: the feature prefix (1 + feature index in the spec).
        prefix_bits: how many high bits hold the prefix.

    Returns:
        uint64 [...] ids.
    """
    bits = np.uint64(prefix_bits)
    high = np.uint64(prefix) << (np.uint64(64) - bits)
    low = raw_hashes >> bits
    low[low == 0] = 1
    low[missing] = 0
    return low | high


def missing_id(prefix: int, prefix_bits: int) -> int:
    return prefix << (64 - prefix_bits)
