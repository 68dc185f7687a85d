"""Dynamic batching: concurrent requests share one forward pass.

Requests queue on the event loop; one worker takes the first waiting request, adds
every request that arrives within `max_delay` (until `max_batch` rows), runs the
batch on one worker thread and hands each request its rows back. While a batch
runs the next one fills, so under load batches grow by themselves and an idle
server adds at most `max_delay` to a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np


@dataclasses.dataclass
class _Request:
    model: Any  # the ServedModel this request was validated against
    ids: np.ndarray  # [n, F] uint64
    dense: np.ndarray  # [n, d] float32
    future: asyncio.Future


class DynamicBatcher:
    """Batches `model.predict(ids, dense)` calls across concurrent requests.

    Args:
        max_batch: most rows in one forward pass (a larger request runs alone).
        max_delay: seconds the first request of a batch waits for others.
    """

    def __init__(self, *, max_batch: int, max_delay: float):
        self.max_batch = max_batch
        self.max_delay = max_delay
        self._queue: asyncio.Queue[_Request] | None = None
        self._worker: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="serving-batch")
        self._carry: _Request | None = None
        self.batches = 0
        self.rows = 0

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._worker = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        self._executor.shutdown(wait=True)

    async def predict(self, model: Any, ids: np.ndarray, dense: np.ndarray):
        """(probabilities [n] float32, unseen [n] int64) of one request's rows."""
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(model, ids, dense, future))
        return await future

    def run_on_worker(self, function: Callable, *args) -> asyncio.Future:
        """Runs `function(*args)` on the batch thread, after every batch already started."""
        return asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    async def _next_batch(self) -> list[_Request]:
        first = self._carry or await self._queue.get()
        self._carry = None
        batch, rows = [first], len(first.ids)
        deadline = asyncio.get_running_loop().time() + self.max_delay
        while rows < self.max_batch:
            timeout = deadline - asyncio.get_running_loop().time()
            try:
                request = (
                    self._queue.get_nowait()
                    if timeout <= 0 or not self._queue.empty()
                    else await asyncio.wait_for(self._queue.get(), timeout)
                )
            except (asyncio.QueueEmpty, TimeoutError):
                break
            if request.model is not first.model or rows + len(request.ids) > self.max_batch:
                self._carry = request  # another model version or no room: the next batch
                break
            batch.append(request)
            rows += len(request.ids)
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            batch = [r for r in batch if not r.future.cancelled()]
            if not batch:
                continue
            model = batch[0].model
            ids = np.concatenate([r.ids for r in batch]) if len(batch) > 1 else batch[0].ids
            dense = np.concatenate([r.dense for r in batch]) if len(batch) > 1 else batch[0].dense
            try:
                probabilities, unseen = await loop.run_in_executor(
                    self._executor, model.predict, ids, dense
                )
            except Exception as error:  # noqa: BLE001 - every request of the batch gets it
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(error)
                continue
            self.batches += 1
            self.rows += len(ids)
            start = 0
            for request in batch:
                stop = start + len(request.ids)
                if not request.future.done():
                    request.future.set_result((probabilities[start:stop], unseen[start:stop]))
                start = stop
