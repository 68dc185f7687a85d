"""PERSIA's hybrid loop: embedding lookups and updates overlap the synchronous dense step.

`HybridLoop.progress()` trains one batch. Its stages, and where each runs:

    read      input thread     batches decoded from the reader, `prefetch` ahead; with
                               device tables, each batch's distinct ids per table
                               (`DeviceRows.dedupe`: it needs the batch alone)
    lookup    lookup thread    takes a staleness slot, then `store.lookup_features` (run by
                               the store's workers), at most `lookahead` batches ahead;
                               device tables: ids to rows, new ids given rows, in step
                               order (`DeviceRows.prepare`)
    transfer  transfer thread  waits for each lookup in order and copies its embeddings,
                               dense features and labels to the devices, device tables'
                               arrays and new rows (their initial values made here) with
                               them (done by the lookup thread when the store answers on
                               its thread)
    step      caller           the jitted dense step, dispatched without waiting for it;
                               then the caller waits until at most `steps_ahead` steps
                               are unfinished (the devices stay busy, the host does not
                               run further ahead of them than that)
    update    update thread    once the step is done: its embedding gradients to the host,
                               mapped back to rows and handed to the store (applied by its
                               workers); the applied update returns the staleness slot

Staleness: the gate has k + 1 slots; a lookup takes one and the applied update of the
same batch returns it, so a lookup misses at most the updates of the k batches before
it (PERSIA's bound), and the gate records how many it did miss. With k = 0 the lookup
of batch t + 1 waits until the update of batch t is applied: the fully synchronous
schedule. With k >= 1 the lookups of the next batches and the update of this one run
while the devices run the dense step, which then never waits for the host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, wait
from typing import Any

import jax
import numpy as np
from hybridrec.training.data.input import Batch, DataPosition
from hybridrec.training.device.batch_shapes import AheadCompiler
from hybridrec.training.layouts import FlatLayout, TowerLayout, feature_ids
from hybridrec.training.staleness import StalenessGate

_END = object()


class LoopClosedError(RuntimeError):
    """The loop was closed: updates still queued are not applied."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What `progress` reports of the step it ran."""

    step: int  # 1-based training step
    metrics: Mapping[str, jax.Array]  # on the devices: fetch them only when logging
    position: DataPosition  # the reader's position after this batch (what checkpoints save)
    staleness: int  # updates the batch's lookup missed
    tokens: int = 0  # a packed batch of histories: the positions holding an item


@dataclasses.dataclass
class _Ready:
    step: int
    batch: Batch
    lookup: Any  # the store's PooledLookup
    device_batch: dict[str, jax.Array]
    staleness: int
    device_rows: Any = None  # the batch's device-table rows (training.device.held_rows.Prepared)


class HybridLoop:
    """Trains batch after batch with lookups and updates overlapping the dense step.

    Args:
        batches: the input stream (read by a background thread).
        state: the dense train state; `loop.state` is the current one.
        train_step: `state, metrics, embedding_grads = train_step(state, device_batch)`.
        store: the embedding store (`lookup_features`, `apply_pooled_gradients`, `set_step`,
            `flush`).
        layout: how the step's batch is laid out (`training.layouts`): the rows and
            features this process looks up, its device batch and its gradients.
        feature_tables: feature name -> table name in the store.
        pooling: how multi-valued features pool their rows.
        staleness: the bound k (0 = synchronous).
        lookahead: lookups issued ahead of the batch being trained, within k (0 = as many
            as k allows); 1 hides the store's latency behind one dense step.
        steps_ahead: after dispatching a step, wait until at most this many dispatched
            steps are unfinished (0 = never wait): what runs ahead of the devices only
            adds staleness.
        first_step: the step number of the first batch.
        prefetch: batches decoded ahead by the input thread.
        replicated: every process holds a full replica of the store: look up and update the
            whole batch; `gather` then concatenates every process's gradients (a collective).
        gather: [local rows, ...] -> [global rows, ...] over all processes.
        nice: lower the background threads' priority by this much (0 = unchanged), so that
            on CPU hosts host work yields the cores to the dense step.
        device_rows: the host side of the tables trained on the devices
            (`training.device.held_rows.DeviceRows`); the store then looks up the layout's
            features only, and `drain` writes the device rows a step changed back to it.
        looks_up: False: another process looks up and updates the rows this one trains
            on (`SequenceLayout.from_chief`); this one only feeds the steps.
    """

    def __init__(
        self,
        batches: Iterator[Batch],
        *,
        state: Any,
        train_step: Callable,
        store: Any,
        layout: FlatLayout | TowerLayout,
        feature_tables: Mapping[str, str],
        pooling: str,
        staleness: int,
        lookahead: int = 1,
        steps_ahead: int = 1,
        first_step: int = 1,
        prefetch: int = 4,
        replicated: bool = False,
        gather: Callable[[np.ndarray], np.ndarray] | None = None,
        nice: int = 0,
        device_rows: Any = None,
        looks_up: bool = True,
    ):
        self.state = state
        self._looks_up = looks_up
        self.device_rows = device_rows
        # device tables: a smaller size of their new rows compiles the step ahead
        self._compiler = None
        if device_rows is not None and hasattr(train_step, "lower"):
            self._compiler = AheadCompiler(train_step)
            device_rows.compile_ahead(self._compiler)
        self.gate = StalenessGate(staleness)
        self._train_step = train_step
        self._store = store
        self._layout = layout
        self._feature_tables = dict(feature_tables)
        self._pooling = pooling
        self._replicated = replicated
        self._gather = gather
        self._nice = nice
        self._ahead = threading.Semaphore(lookahead) if lookahead > 0 else None
        self._steps_ahead = steps_ahead
        self._unfinished: list[Any] = []  # outputs of dispatched steps, oldest first
        self._lookup_lock = threading.Lock()
        self._paused = False
        # (lookup, embedding gradients) of each dense step, in order, for the update thread
        self._updates: queue.Queue = queue.Queue()
        self._errors: list[BaseException] = []
        self._times: dict[str, float] = {}
        self._timed_steps = 0
        self._slowest = 0.0
        self._stop = threading.Event()
        self._input: queue.Queue = queue.Queue(maxsize=prefetch)
        self._looked_up: queue.Queue = queue.Queue()
        self._ready: queue.Queue = queue.Queue()
        self._next_step = first_step
        # A store that answers on the caller's thread has its rows at hand when the lookup
        # returns: the lookup thread then copies them to the devices itself (no hand-off).
        self._direct = bool(getattr(store, "inline", False))
        self._threads = [
            threading.Thread(target=self._read, args=(batches,), name="hybridrec-input"),
            threading.Thread(target=self._lookup, args=(first_step,), name="hybridrec-lookup"),
            threading.Thread(target=self._update, name="hybridrec-update"),
        ]
        if not self._direct:
            self._threads.append(threading.Thread(target=self._transfer, name="hybridrec-transfer"))
        for thread in self._threads:
            thread.daemon = True
            thread.start()

    # ---- the caller's side -------------------------------------------------------------

    def progress(self, *, quiesce: bool = False) -> StepResult | None:
        """Trains the next batch; None once the input is exhausted.

        Args:
            quiesce: after this step, apply every update and pause lookups until `resume()`,
                so the store holds exactly the updates up to this step (checkpoints).
        """
        self._raise_errors()
        clock = started = time.perf_counter()
        item = self._take()
        if item is None:
            return None
        if item.device_rows is not None and item.device_rows.compiled is not None:
            # the step's compile for its new shapes (one an earlier loop's close cancelled
            # is not waited for: the call compiles)
            wait([item.device_rows.compiled])
        clock = self._time("wait_ms", clock)
        if self._compiler is not None:
            self._compiler.saw(self.state, item.device_batch)
        self.state, metrics, embedding_grads = self._train_step(self.state, item.device_batch)
        evicted = None
        if item.device_rows is not None:
            self.device_rows.trained(item.device_rows)
            if self.device_rows.caches:  # the rows the caches evicted come out of the step
                embedding_grads, evicted = embedding_grads
        clock = self._time("step_ms", clock)
        if self._steps_ahead:
            self._unfinished.append(metrics)
            while len(self._unfinished) > self._steps_ahead:
                jax.block_until_ready(self._unfinished.pop(0))
            clock = self._time("device_ms", clock)
        if quiesce:
            self._pause_lookups()  # no lookup may slip in between this update and the snapshot
        if self._replicated and item.lookup is not None:  # a collective: every process, in
            # step order, on this thread (none when every table is on the devices)
            embedding_grads = self._gather(self._layout.gradients(embedding_grads))
        self._updates.put((item.lookup, embedding_grads, item.device_rows, evicted))
        if quiesce:
            self.drain()
        self._time("update_ms", clock)
        self._timed_steps += 1
        self._slowest = max(self._slowest, (time.perf_counter() - started) * 1e3)
        tokens = getattr(item.batch, "tokens", 0)  # sequence batches count their positions
        return StepResult(item.step, metrics, item.batch.position, item.staleness, tokens)

    def drain(self) -> None:
        """Returns once every update handed over is applied in the store, and the rows
        trained on the devices are written back to it: the store holds the whole table."""
        self._updates.join()
        self._store.flush()
        self._raise_errors()
        if self.device_rows is not None:
            self.device_rows.write_back(self.state, self._store)

    def resume(self) -> None:
        """Lets lookups go on after a `progress(quiesce=True)`."""
        if self._paused:
            self._paused = False
            self._lookup_lock.release()

    def timings(self) -> dict[str, float]:
        """Milliseconds per step in each of the caller's phases since the last call, and
        the slowest single step (`slowest_step_ms`)."""
        steps = max(self._timed_steps, 1)
        out = {name: round(total / steps, 3) for name, total in self._times.items()}
        out["slowest_step_ms"] = round(self._slowest, 3)
        self._times, self._timed_steps, self._slowest = {}, 0, 0.0
        return out

    def close(self) -> None:
        """Stops the background threads; updates not yet handed to the store are dropped."""
        self._stop.set()
        self._errors.append(LoopClosedError("the hybrid loop is closed"))
        self._updates.put(_END)
        self.resume()
        for thread in self._threads:
            thread.join(timeout=10)
        if self._compiler is not None:
            self._compiler.close()

    def __enter__(self) -> HybridLoop:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _time(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self._times[name] = self._times.get(name, 0.0) + (now - since) * 1e3
        return now

    def _take(self) -> _Ready | None:
        item = self._get(self._ready)
        if isinstance(item, _Ready) and self._ahead is not None:
            self._ahead.release()  # training starts on it: the next lookup may go out
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def _applied(self, future: Future) -> None:
        error = future.exception()
        if error is not None:
            self._errors.append(error)
        self.gate.release()

    def _pause_lookups(self) -> None:
        if not self._paused:
            self._lookup_lock.acquire()
            self._paused = True

    def _raise_errors(self) -> None:
        if self._errors:
            raise self._errors[0]

    # ---- background threads ------------------------------------------------------------

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
                if self._errors:  # an update failed: stop waiting for lookups behind it
                    self._raise_errors()
        return _END

    def _read(self, batches: Iterator[Batch]) -> None:
        lower_thread_priority(self._nice)
        try:
            for batch in batches:
                # device tables: the half of a batch's preparation that needs the batch
                # alone (its distinct ids), here, ahead of the lookup thread's step order
                deduped = self.device_rows.dedupe(batch) if self.device_rows else None
                if not self._put(self._input, (batch, deduped)):
                    return
            self._put(self._input, _END)
        except BaseException as error:  # handed to the caller, who raises it
            self._put(self._input, error)

    def _lookup(self, step: int) -> None:
        # The store's workers start on their first request and inherit this priority.
        lower_thread_priority(self._nice)
        try:
            while True:
                item = self._get(self._input)
                if item is _END or isinstance(item, BaseException):
                    self._put(self._ready if self._direct else self._looked_up, item)
                    return
                item, deduped = item
                if self._ahead is not None:
                    while not self._ahead.acquire(timeout=0.05):
                        if self._stop.is_set():
                            return
                staleness = self.gate.acquire(self._stop)
                if staleness is None:
                    return
                with self._lookup_lock:
                    self._store.set_step(step)
                    # a replica looks up (and later updates) the whole global batch; a
                    # shared store only this process's rows
                    rows = None if self._replicated else self._layout.rows
                    if self.device_rows and self.device_rows.caches:
                        # caches first: the host looks up the ids they do not hold
                        on_devices = self.device_rows.prepare(item, deduped)
                        future = self._host_lookup(on_devices.host_batch(item), rows)
                    else:
                        future = self._host_lookup(item, rows)
                        # device tables: new ids get their rows here, in step order
                        on_devices = self.device_rows and self.device_rows.prepare(item, deduped)
                if self._direct:
                    self._put(
                        self._ready, self._to_devices(step, item, future, staleness, on_devices)
                    )
                else:
                    self._put(self._looked_up, (step, item, future, staleness, on_devices))
                step += 1
        except BaseException as error:
            self._put(self._ready if self._direct else self._looked_up, error)

    def _host_lookup(self, batch: Batch, rows: slice | None) -> Future:
        """The store's lookup of the batch's host features (None when every feature's
        table is on the devices, or when another process looks the rows up)."""
        if self._layout.features == [] or not self._looks_up:
            done: Future = Future()
            done.set_result(None)
            return done
        return self._store.lookup_features(
            feature_ids(batch, rows, self._layout.features),
            feature_tables=self._feature_tables,
            pooling=self._pooling,
        )

    def _transfer(self) -> None:
        lower_thread_priority(self._nice)
        try:
            while True:
                item = self._get(self._looked_up)
                if item is _END or isinstance(item, BaseException):
                    self._put(self._ready, item)
                    return
                self._put(self._ready, self._to_devices(*item))
        except BaseException as error:
            self._put(self._ready, error)

    def _to_devices(
        self, step: int, batch: Batch, future: Future, staleness: int, on_devices: Any = None
    ) -> _Ready:
        """Waits for the batch's lookup and copies what the step needs to the devices."""
        lookup = future.result()
        rows = self._layout.rows
        if lookup is None and isinstance(batch, Batch) and self.device_rows is not None:
            dim = self.device_rows.tables[0].dim  # no host features: [rows, 0, dim]
            embeddings = np.zeros((len(batch.dense[rows]), 0, dim), np.float32)
        elif lookup is None:  # a sequence batch's rows on the devices or another process's
            embeddings = None
        elif self._replicated:
            embeddings = lookup.embeddings[rows]
        else:
            embeddings = lookup.embeddings
        extra = self.device_rows.host_arrays(on_devices, rows) if on_devices else None
        arrays = self._layout.device_batch(batch, embeddings, extra=extra)
        return _Ready(step, batch, lookup, arrays, staleness, on_devices or None)

    def _update(self) -> None:
        # Not lowered: an update that lags raises the staleness the next lookups see.
        while True:
            item = self._updates.get()
            try:
                if item is _END:
                    return
                self._apply(*item)
            finally:
                self._updates.task_done()

    def _apply(
        self,
        lookup: Any,
        embedding_grads: jax.Array | np.ndarray,
        prepared: Any = None,
        evicted: Any = None,
    ) -> None:
        """Hands one step's update to the store (whose shard workers apply them in order):
        the rows its caches evicted, then its embedding gradients."""
        if self._errors or lookup is None:  # after a failure, or nothing looked up
            self.gate.release()
            return
        try:
            futures = []
            if evicted is not None:
                futures += self.device_rows.write_evicted(prepared, evicted, self._store)
            grads = embedding_grads
            if not isinstance(grads, np.ndarray):
                grads = self._layout.gradients(grads)  # waits for the step to finish
            at = getattr(prepared, "host_at", None)  # a sequence step's padded rows: the first
            grads = grads[: len(lookup.embeddings)] if at is None else grads[at]  # looked up
            futures.append(self._store.apply_pooled_gradients(lookup, grads))
        except BaseException as error:  # reported to the caller by progress / drain
            self._errors.append(error)
            self.gate.release()
            return
        if len(futures) == 1:
            futures[0].add_done_callback(self._applied)
            return
        remaining = [len(futures)]
        lock = threading.Lock()

        def done(future: Future) -> None:  # the slot returns once every part is applied
            if future.exception() is not None:
                self._errors.append(future.exception())
            with lock:
                remaining[0] -= 1
                last = not remaining[0]
            if last:
                self.gate.release()

        for future in futures:
            future.add_done_callback(done)


def lower_thread_priority(nice: int) -> None:
    """Raises the calling thread's nice value by `nice` (no-op where not permitted)."""
    if nice > 0 and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
