"""How the store runs its calls: a worker thread per shard, or on the caller's thread.

`when_all` joins the futures of one store call (one per shard) into the future the
caller gets; `Inline` is the executor of a store with one in-process shard.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np


def when_all(futures: Sequence[Future], combine: Callable[[list], Any], pool) -> Future:
    """A future for `combine([results])`, computed on `pool` once every input is done."""
    result: Future = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def finish():
        try:
            result.set_result(combine([f.result() for f in futures]))
        except BaseException as error:  # noqa: BLE001 - handed to the caller's future
            result.set_exception(error)

    def done(_):
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            result.set_exception(errors[0])
        else:
            try:
                pool.submit(finish)
            except RuntimeError:  # pool shut down: finish here
                finish()

    if not futures:
        pool.submit(finish)
    for future in futures:
        future.add_done_callback(done)
    return result


def join_rows(routes: Sequence[tuple[int, Any]], parts: Sequence[tuple], count: int) -> tuple:
    """Per-shard (values, state) answers, in route order -> (values, state) of all `count`
    ids in the caller's order (routes: [(shard, positions or slice)])."""
    if len(parts) == 1:
        return parts[0]
    out = tuple(np.empty((count, part.shape[1]), part.dtype) for part in parts[0])
    for (_, at), part in zip(routes, parts, strict=True):
        for whole, piece in zip(out, part, strict=True):
            whole[at] = piece
    return out


class Inline:
    """An executor that runs each call at once on the calling thread.

    The store's calls to one in-process shard go through it: the shard's tables lock
    themselves, and the native kernels release the GIL, so a thread hand-off per request
    (and another to combine the result) would cost more than it overlaps.
    """

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # noqa: BLE001 - handed to the caller's future
            future.set_exception(error)
        return future

    def shutdown(self, wait: bool = True) -> None:
        pass
