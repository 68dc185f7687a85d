"""Dynamic batching: concurrent requests share one parse and one forward pass.

Requests queue on the event loop; one worker takes the first waiting request, adds
every request that arrives within `max_delay` (until `max_batch` rows), runs the
batch on one worker thread and hands each request its rows back. While a batch
runs the next one fills, so under load batches grow by themselves and an idle
server adds at most `max_delay` to a request.

Raw rows of all requests of a batch are parsed as one block (parsing has a fixed
cost per call that single-row requests would otherwise pay each). If the block holds
a bad row, each raw request is parsed on its own, so only the request with the bad
row fails, with the row's index in that request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from hybridrec.common.errors import UserError
from hybridrec.serving.bags import concatenate, num_rows, slice_rows


@dataclasses.dataclass
class _Request:
    model: Any  # the ServedModel this request was validated against
    rows: int  # rows in the request
    future: asyncio.Future
    lines: list | None = None  # raw rows, or:
    ids: Any = None  # [n, F] uint64, or {feature: [n] uint64 | RaggedIds} (serving.bags)
    dense: np.ndarray | None = None  # [n, d] float32
    payload: Any = None  # or a request the model runs itself (`model.run_batch`)


def _encode(model: Any, batch: list[_Request]) -> dict[int, Any]:
    """{index in batch: (ids, dense) or the RowError} of the batch's raw-row requests."""
    raw = [index for index, request in enumerate(batch) if request.lines is not None]
    if not raw:
        return {}
    try:
        ids, dense = model.encode_rows([line for i in raw for line in batch[i].lines])
    except UserError:
        encoded = {}
        for index in raw:
            try:
                encoded[index] = model.encode_rows(batch[index].lines)
            except UserError as error:
                encoded[index] = error
        return encoded
    bounds = np.cumsum([0] + [batch[i].rows for i in raw])
    return {
        index: (slice_rows(ids, start, stop), dense[start:stop])
        for index, start, stop in zip(raw, bounds[:-1], bounds[1:], strict=True)
    }


def _execute(model: Any, batch: list[_Request]) -> list[Any]:
    """Per request: (probabilities [n], unseen [n]), or `model.run_batch`'s answer, or the
    exception it gets."""
    if batch[0].payload is not None:
        return model.run_batch([request.payload for request in batch])
    encoded = _encode(model, batch)
    inputs = [encoded.get(i, (request.ids, request.dense)) for i, request in enumerate(batch)]
    good = [i for i, item in enumerate(inputs) if not isinstance(item, Exception)]
    results: list[Any] = list(inputs)
    if not good:
        return results
    ids = concatenate([inputs[i][0] for i in good])
    dense = np.concatenate([inputs[i][1] for i in good])
    probabilities, unseen = model.predict(ids, dense)
    start = 0
    for i in good:
        stop = start + batch[i].rows
        results[i] = (probabilities[start:stop], unseen[start:stop])
        start = stop
    return results


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

    async def predict(
        self,
        model: Any,
        *,
        lines: list | None = None,
        ids: Any = None,
        dense: np.ndarray | None = None,
    ):
        """(probabilities [n] float32, unseen [n] int64) of one request's rows.

        Pass raw `lines`, or hashed `ids` ([n, F] uint64 or {feature: [n] uint64 |
        RaggedIds}) and `dense` [n, d] float32.

        Raises:
            pipeline.RowError: a raw row the Beam job would reject.
        """
        future = asyncio.get_running_loop().create_future()
        rows = len(lines) if lines is not None else num_rows(ids)
        await self._queue.put(_Request(model, rows, future, lines=lines, ids=ids, dense=dense))
        return await future

    async def submit(self, model: Any, payload: Any, rows: int) -> Any:
        """`model.run_batch([payload, ...])`'s answer for `payload` (a request of `rows`
        rows), batched with the other payloads that arrive meanwhile."""
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(model, rows, future, payload=payload))
        return await future

    def run_on_worker(self, function: Callable, *args) -> asyncio.Future:
        """Runs `function(*args)` on the batch thread, after every batch already started."""
        return asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    async def _next_batch(self) -> list[_Request]:
        first = self._carry or await self._queue.get()
        self._carry = None
        batch, rows = [first], first.rows
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
            if (
                request.model is not first.model
                or (request.payload is None) != (first.payload is None)
                or rows + request.rows > self.max_batch
            ):
                self._carry = request  # another model version or no room: the next batch
                break
            batch.append(request)
            rows += request.rows
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            batch = [r for r in batch if not r.future.cancelled()]
            if not batch:
                continue
            try:
                results = await loop.run_in_executor(
                    self._executor, _execute, batch[0].model, batch
                )
            except Exception as error:  # noqa: BLE001 - every request of the batch gets it
                results = [error] * len(batch)
            self.batches += 1
            self.rows += sum(r.rows for r in batch)
            for request, result in zip(batch, results, strict=True):
                if request.future.done():
                    continue
                if isinstance(result, Exception):
                    request.future.set_exception(result)
                else:
                    request.future.set_result(result)
