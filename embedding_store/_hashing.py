"""Counter-based 64-bit mixing (splitmix64 finalizer), vectorized over numpy arrays.

Different salts give independent hash families: shard routing, in-shard slot
probing, initial values and admission draws must not be correlated.
"""

from __future__ import annotations

import numpy as np
from hybridrec.common import splitmix

_GOLDEN = np.uint64(splitmix.GOLDEN)
_MUL1 = np.uint64(splitmix.MUL1)
_MUL2 = np.uint64(splitmix.MUL2)

SALT_ROUTE = 0x5A17_0001
SALT_SLOT = 0x5A17_0002
SALT_INIT = 0x5A17_0003
SALT_ADMIT = 0x5A17_0004


def salt_offset(salt: int) -> int:
    """What `mix64` adds to each value before mixing: (salt + 1) * golden, mod 2^64."""
    return ((salt + 1) * int(_GOLDEN)) & 0xFFFFFFFFFFFFFFFF


def mix64(values: np.ndarray, salt: int) -> np.ndarray:
    """splitmix64 of `values + (salt + 1) * golden`; uint64 in, new uint64 array out."""
    z = np.add(values, np.uint64(salt_offset(salt)), dtype=np.uint64)
    z ^= z >> np.uint64(30)
    z *= _MUL1
    z ^= z >> np.uint64(27)
    z *= _MUL2
    z ^= z >> np.uint64(31)
    return z


def unit_float(bits: np.ndarray) -> np.ndarray:
    """Top 53 bits of uint64 -> float64 uniform in [0, 1)."""
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
