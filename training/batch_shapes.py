"""The sizes the device tables' batch arrays are padded to.

Every distinct set of shapes compiles the train step again: about a quarter of a second
for the `criteo_dlrm` step on two CPU cores, seconds for the MLPerf shape on a GPU. The
sizes are powers of two, so a table hovering about one size compiles once. A size that
follows the batches both ways (a batch's new rows: tens of thousands while the tables
fill, a few hundred once they have) would compile at every power of two it crosses
downwards; `PaddedSizes.fit` shrinks only when the padding carried since the last change
has cost more than a compile is worth (`WASTE_BYTES`).
"""

from __future__ import annotations

import dataclasses

# padding bytes a size carries before it shrinks: at 5-20 GB/s of host copies and
# transfers, a few tenths of a second, about what the step's compile costs
WASTE_BYTES = 2 << 30


def bucket(size: int) -> int:
    """The power of two at or above `size` (1 for 0)."""
    return 1 << (max(int(size), 1) - 1).bit_length()


@dataclasses.dataclass
class _Fitted:
    size: int
    waste: int = 0  # padding bytes carried since the size last changed
    peak: int = 0  # the largest size needed since then


class PaddedSizes:
    """Per key, the power of two batches are padded to."""

    def __init__(self, waste_bytes: int = WASTE_BYTES):
        self.waste_bytes = waste_bytes
        self._grown: dict[str, int] = {}
        self._fitted: dict[str, _Fitted] = {}

    def grow(self, key: str, need: int) -> int:
        """A size for `need` entries that never shrinks: `need` bucketed, or the larger size
        `key` had before."""
        size = max(self._grown.get(key, 0), bucket(need))
        self._grown[key] = size
        return size

    def fit(self, key: str, need: int, entry_bytes: int) -> int:
        """A size for `need` entries of `entry_bytes` each: it grows at once, and comes down
        to the largest size needed since it last changed once the padding carried since then
        passes `waste_bytes`."""
        size = bucket(need)
        fitted = self._fitted.get(key)
        if fitted is None or size > fitted.size:
            self._fitted[key] = _Fitted(size)
            return size
        fitted.peak = max(fitted.peak, size)
        fitted.waste += (fitted.size - size) * entry_bytes
        if fitted.waste > self.waste_bytes and fitted.peak < fitted.size:
            self._fitted[key] = _Fitted(fitted.peak)
        return self._fitted[key].size
