"""Growing arrays in doubling steps without stalling the step that crosses one.

A table's slot arrays and its slot map start small and double as rows arrive (up to
capacity), so memory follows the rows held and each row is copied O(1) times on
average. What would stall the call that triggers a doubling is not the copy itself
but the page faults of the fresh array: first writes to new memory cost far more than
the memcpy. So when an array is three quarters full, `Spare.prepare` allocates its
next size on a background thread and touches the pages the copy will write; the
growth step then only copies (`Spare.grow`). If the spare is not ready yet, the step
waits for it (it is already under way) or allocates one itself.
"""

from __future__ import annotations

import os

import numpy as np
from hybridrec.embedding_store._pools import ForkSafePool

PREPARE_AT = 0.75  # fraction of an array in use when its next size is prepared

# the one thread that prepares growth steps (slot arrays, slot maps) ahead of need
_background = ForkSafePool(1, "embedding-growth")


class Ahead:
    """`function(*args)` computed on the growth thread, ahead of the call that needs it."""

    def __init__(self, function, *args):
        self._pid = os.getpid()
        self._future = _background.submit(function, *args)

    def done(self) -> bool:
        return self._pid != os.getpid() or self._future.done()

    def take(self):
        """The result, waiting for it if it is under way; None if it had not started (it is
        dropped), or was started by the parent of this forked process. The caller then
        does the work itself."""
        if self._pid != os.getpid() or self._future.cancel():
            return None
        return self._future.result()

    def drop(self) -> None:
        """Not needed after all: cancelled if it has not started."""
        self._future.cancel()


def _allocate(shape: tuple[int, ...], dtype: np.dtype, fill, touch: int) -> np.ndarray:
    """A new array of `shape` holding `fill`, its first `touch` rows backed by memory."""
    if fill == 0:
        array = np.zeros(shape, dtype)  # lazily backed: only written pages cost memory
        array[:touch] = 0  # page in what the copy will overwrite (numpy drops the GIL)
        return array
    return np.full(shape, fill, dtype)


class Spare:
    """The next, larger version of one growable array, prepared in the background."""

    def __init__(self):
        self._ahead: Ahead | None = None
        self._shape: tuple[int, ...] | None = None

    def prepare(self, array: np.ndarray, rows: int, fill=0, touch: int | None = None) -> None:
        """Starts allocating `array` grown to `rows` rows (once per target size).

        `touch` rows are paged in (default: as many as `array` has, what `grow` copies).
        """
        shape = (rows, *array.shape[1:])
        if self._shape == shape or rows <= len(array):
            return
        if self._ahead is not None:
            self._ahead.drop()
        self._shape = shape
        touch = len(array) if touch is None else touch
        self._ahead = Ahead(_allocate, shape, array.dtype, fill, touch)

    def grow(self, array: np.ndarray, rows: int, fill=0) -> np.ndarray:
        """`array` grown to `rows` rows (the prepared spare when it has that size)."""
        if rows <= len(array):
            return array
        shape = (rows, *array.shape[1:])
        ahead, self._ahead, prepared, self._shape = self._ahead, None, self._shape, None
        grown = None
        if ahead is not None and prepared == shape:
            grown = ahead.take()
        elif ahead is not None:
            ahead.drop()
        if grown is None:
            grown = _allocate(shape, array.dtype, fill, 0)
        grown[: len(array)] = array
        return grown
