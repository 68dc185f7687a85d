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

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

PREPARE_AT = 0.75  # fraction of an array in use when its next size is prepared

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def background() -> ThreadPoolExecutor:
    """The one thread that prepares growth steps (slot arrays, slot maps) ahead of need."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="embedding-growth")
        return _pool


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
        self._future: Future | None = None
        self._shape: tuple[int, ...] | None = None

    def prepare(self, array: np.ndarray, rows: int, fill=0, touch: int | None = None) -> None:
        """Starts allocating `array` grown to `rows` rows (once per target size).

        `touch` rows are paged in (default: as many as `array` has, what `grow` copies).
        """
        shape = (rows, *array.shape[1:])
        if self._shape == shape or rows <= len(array):
            return
        if self._future is not None:
            self._future.cancel()
        self._shape = shape
        touch = len(array) if touch is None else touch
        self._future = background().submit(_allocate, shape, array.dtype, fill, touch)

    def grow(self, array: np.ndarray, rows: int, fill=0, *, copy: bool = True) -> np.ndarray:
        """`array` grown to `rows` rows (the prepared spare when it has that size).

        With `copy=False` the result holds only `fill` (the caller refills it).
        """
        if rows <= len(array) and copy:
            return array
        shape = (rows, *array.shape[1:])
        future, self._future, self._shape, prepared = self._future, None, None, self._shape
        grown = None
        if future is not None and prepared == shape and not future.cancel():
            grown = future.result()  # started (or done): waiting costs less than starting over
        if grown is None:
            grown = _allocate(shape, array.dtype, fill, 0)
        if copy:
            grown[: len(array)] = array
        return grown
