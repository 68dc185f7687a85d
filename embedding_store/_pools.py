"""Module-level thread pools that survive a fork."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

# threads a native kernel's work is split over (the kernels hold no GIL)
NATIVE_THREADS = max(1, min(8, os.cpu_count() or 1))


class ForkSafePool:
    """A thread pool made on first use, and made again in a forked child (which inherits
    the parent's pool object but none of its threads)."""

    def __init__(self, workers: int, prefix: str):
        self._workers, self._prefix = workers, prefix
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def submit(self, function, *args) -> Future:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix=self._prefix)
                self._pid = os.getpid()
            pool = self._pool
        return pool.submit(function, *args)

    def in_parts(self, length: int, parts: int, call: Callable[[int, int], object]) -> None:
        """`call(lo, hi)` for `parts` equal parts of range(length): the first on this
        thread, the others on the pool; returns once every part is done."""
        bounds = [length * i // parts for i in range(parts + 1)]
        futures = [
            self.submit(call, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:], strict=True)
        ]
        try:
            call(bounds[0], bounds[1])
        finally:
            wait(futures)  # no part still at work when this returns or raises
        for future in futures:
            future.result()
