"""PERSIA's bound on staleness: the gate the hybrid loop's lookups pass through.

The gate has k + 1 slots; a lookup takes one and the applied update of the same batch
returns it, so a lookup misses at most the updates of the k batches before it, and the
gate records how many it did miss (`training.hybrid.HybridLoop`).
"""

from __future__ import annotations

import threading

import numpy as np


class StalenessGate:
    """At most `k` batches looked up but not yet applied when a new lookup is issued.

    Args:
        k: the staleness bound (0 = synchronous).
    """

    def __init__(self, k: int):
        self.k = k
        self._slots = threading.Semaphore(k + 1)
        self._lock = threading.Lock()
        self.in_flight = 0  # batches looked up whose updates are not yet applied
        self.max_staleness = 0  # largest staleness recorded
        self.histogram = np.zeros(k + 1, np.int64)  # lookups per staleness

    def acquire(self, stop: threading.Event) -> int | None:
        """Blocks for a slot; returns the staleness of the lookup about to be issued.

        Returns None when `stop` is set while waiting.
        """
        while not self._slots.acquire(timeout=0.05):
            if stop.is_set():
                return None
        with self._lock:
            staleness = self.in_flight
            self.in_flight += 1
            self.max_staleness = max(self.max_staleness, staleness)
        if staleness > self.k:  # cannot happen while the slot count is k + 1
            raise AssertionError(f"staleness {staleness} exceeds the bound {self.k}")
        self.histogram[staleness] += 1
        return staleness

    def release(self) -> None:
        """Called when a batch's embedding update has been applied (or abandoned)."""
        with self._lock:
            self.in_flight -= 1
        self._slots.release()
