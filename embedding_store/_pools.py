"""Module-level thread pools that survive a fork."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor


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
