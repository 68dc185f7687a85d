"""The asynchronous half of the hybrid loop: input thread, lookahead lookups, staleness bound.

    input thread ──► batches ──► lookup thread ──► (batch, lookup future) ──► trainer
                                   │ acquires a staleness slot           │ step, then
                                   ▼                                     ▼ apply (async)
                               StalenessGate ◄──── slot released when the apply completes

`StalenessGate` has k + 1 slots: a lookup takes one, the completion of that batch's
gradient update returns it. So when a lookup is issued, at most k other batches are
looked up but not yet applied — its *staleness*, which the gate records. With k = 0
the lookup of batch t + 1 waits until the update of batch t is in the store: the
fully synchronous schedule. Independently, `lookahead` limits how far ahead of the
trainer lookups go: far enough to hide the store's latency, not further, so the
staleness actually used stays below the bound when the bound is generous.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

from training.input import Batch

_END = object()


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
        self.max_staleness = 0  # largest staleness ever recorded
        self.recorded = 0  # lookups recorded

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
            self.recorded += 1
            self.max_staleness = max(self.max_staleness, staleness)
        if staleness > self.k:  # cannot happen while the slot count is k + 1
            raise AssertionError(f"staleness {staleness} exceeds the bound {self.k}")
        return staleness

    def release(self) -> None:
        """Called when a batch's gradient update has been applied (or abandoned)."""
        with self._lock:
            self.in_flight -= 1
        self._slots.release()


@dataclasses.dataclass
class LookedUp:
    """A batch whose pooled embeddings are being fetched."""

    step: int  # the training step that will consume it (1-based)
    batch: Batch  # the batch as read
    lookup: Future  # Future[PooledLookup]
    staleness: int  # updates pending in the store when the lookup was issued


class LookaheadPipeline:
    """Runs the input and the lookups ahead of the trainer, within the staleness bound.

    Args:
        batches: the input stream (read by a background thread).
        first_step: step number of the first batch.
        issue_lookup: (step, batch) -> Future[PooledLookup]; called in stream order.
        gate: the staleness bound.
        prefetch: batches buffered between the input thread and the lookup thread.
        lookup_lock: held around every lookup issue; the trainer takes it to pause
            lookups (e.g. while a checkpoint is written).
        nice: raise the input and lookup threads' nice value by this much (0 = leave).
        lookahead: lookups issued ahead of the batch being trained (0 = as many as the
            staleness bound allows). Issuing them only as early as needed to hide the
            store's latency keeps the staleness actually used below the bound.
    """

    def __init__(
        self,
        batches: Iterator[Batch],
        *,
        first_step: int,
        issue_lookup: Callable[[int, Batch], Future],
        gate: StalenessGate,
        prefetch: int,
        lookup_lock: threading.Lock,
        nice: int = 0,
        lookahead: int = 0,
    ):
        # at most `lookahead` lookups issued for batches the trainer has not started on
        self._ahead = threading.Semaphore(lookahead) if lookahead > 0 else None
        self._batches = batches
        self._nice = nice
        self._first_step = first_step
        self._issue_lookup = issue_lookup
        self._gate = gate
        self._lookup_lock = lookup_lock
        self._stop = threading.Event()
        self._input: queue.Queue = queue.Queue(maxsize=prefetch)
        self._ready: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(target=self._read, name="hybridrec-input", daemon=True),
            threading.Thread(target=self._lookahead, name="hybridrec-lookup", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _put(self, target: queue.Queue, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                target.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _get(self, source: queue.Queue) -> Any:
        while not self._stop.is_set():
            try:
                return source.get(timeout=0.05)
            except queue.Empty:
                continue
        return _END

    def _lower_priority(self) -> None:
        # The dense step must not wait for host threads: on a CPU-only host XLA's device
        # threads share the cores with this work, and one preempted device thread stalls
        # every collective. Threads started from here (the store's workers are created on
        # their first request) inherit the lower priority.
        lower_thread_priority(self._nice)

    def _read(self) -> None:
        self._lower_priority()
        try:
            for batch in self._batches:
                if not self._put(self._input, batch):
                    return
            self._put(self._input, _END)
        except BaseException as error:  # handed to the trainer, which re-raises it
            self._put(self._input, error)

    def _lookahead(self) -> None:
        self._lower_priority()
        step = self._first_step
        try:
            while True:
                item = self._get(self._input)
                if item is _END or isinstance(item, BaseException):
                    self._put(self._ready, item)
                    return
                if self._ahead is not None:
                    while not self._ahead.acquire(timeout=0.05):
                        if self._stop.is_set():
                            return
                staleness = self._gate.acquire(self._stop)
                if staleness is None:
                    return
                with self._lookup_lock:
                    future = self._issue_lookup(step, item)
                self._put(self._ready, LookedUp(step, item, future, staleness))
                step += 1
        except BaseException as error:
            self._put(self._ready, error)

    def next(self) -> LookedUp | None:
        """The next looked-up batch, or None at the end of the stream."""
        item = self._get(self._ready)
        if self._ahead is not None and isinstance(item, LookedUp):
            self._ahead.release()  # the trainer starts on it: the next lookup may go out
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stops both threads (batches already looked up are dropped)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)


def lower_thread_priority(nice: int) -> None:
    """Raises the calling thread's nice value by `nice` (no-op where not permitted)."""
    if nice > 0 and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


class UpdatePusher:
    """Hands each batch's embedding gradients to the store, in order.

    By default the caller's thread does it (mapping pooled gradients back to rows and
    routing them to shards takes a few ms per batch); with `background=True` a thread
    does it beside the next dense step, which frees the trainer's main thread but lets
    updates queue up when the store is the bottleneck, so the staleness actually used
    moves toward the bound. A batch's staleness slot is returned when the store has
    applied its update.

    Args:
        apply: (lookup, grads) -> Future[None], e.g. `store.apply_pooled_gradients`.
        gate: the staleness bound whose slots the updates return.
        background: hand updates over from a background thread.
        nice: nice-value increment of that thread (0 = unchanged).
    """

    def __init__(
        self,
        apply: Callable[[Any, Any], Future],
        gate: StalenessGate,
        *,
        background: bool = False,
        nice: int = 0,
    ):
        self._apply = apply
        self._gate = gate
        self._nice = nice
        self.errors: list[BaseException] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, name="hybridrec-apply", daemon=True)
            self._thread.start()

    def push(self, lookup: Any, grads: Any) -> None:
        if self.errors:
            raise self.errors[0]
        if self._thread is None:
            release_when_done(self._apply(lookup, grads), self._gate, self.errors)
        else:
            self._queue.put((lookup, grads))

    def _run(self) -> None:
        lower_thread_priority(self._nice)
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self.errors:  # after a failure, return the slots without applying
                    self._gate.release()
                    continue
                try:
                    release_when_done(self._apply(*item), self._gate, self.errors)
                except BaseException as error:  # reported to the trainer by push / drain
                    self.errors.append(error)
                    self._gate.release()
            finally:
                self._queue.task_done()

    def drain(self) -> None:
        """Returns once every pushed update has been handed to the store (then flush it)."""
        self._queue.join()
        if self.errors:
            raise self.errors[0]

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)


def release_when_done(future: Future, gate: StalenessGate, errors: list[BaseException]) -> None:
    """Returns the batch's staleness slot once its update future completes."""

    def done(completed: Future) -> None:
        error = completed.exception()
        if error is not None:
            errors.append(error)
        gate.release()

    future.add_done_callback(done)


def feature_ids(batch: Batch, rows: slice | None = None) -> Mapping[str, Any]:
    """The batch's ids, optionally restricted to a slice of rows (single-valued or ragged)."""
    if rows is None or rows == slice(None):
        return batch.ids
    out = {}
    for name, ids in batch.ids.items():
        if hasattr(ids, "offsets"):
            start, stop = rows.start, rows.stop
            offsets = ids.offsets[start : stop + 1]
            out[name] = type(ids)(
                values=ids.values[offsets[0] : offsets[-1]], offsets=offsets - offsets[0]
            )
        else:
            out[name] = ids[rows]
    return out
