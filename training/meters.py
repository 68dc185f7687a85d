"""What the trainer measures between two log lines: loss, throughput, staleness, and the
store's counters, without stalling a step to read them."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from hybridrec.model import check_finite_losses
from hybridrec.training.device.batch_shapes import AHEAD_THREAD
from hybridrec.training.device.plan import memory_stats
from hybridrec.training.hybrid import StepResult


def device_memory() -> dict[str, Any] | None:
    """The peak and the limit of device memory over this process's devices (bytes), as
    the backend reports them (a GPU's allocator); None where it reports none (CPU)."""
    peak = limit = None
    for device in jax.local_devices():
        stats = memory_stats(device)
        if stats is None:
            return None
        used = stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0))
        peak = max(peak or 0, int(used))
        limit = max(limit or 0, int(stats.get("bytes_limit", 0)))
    if peak is None:
        return None
    return {"peak_bytes_per_device": peak, "bytes_limit_per_device": limit}


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # JAX's, per XLA compile


class CompileMeter:
    """XLA compiles in this process while it is open, and their seconds (JAX's monitoring
    events; a persistent-cache hit counts, taking little time): a step compiled again for
    a new shape shows in a log interval's `compiles` and `compile_s`. Those made ahead on
    the hybrid loop's compile worker (`training.device.batch_shapes.AheadCompiler`), which no step
    waits for, are counted apart: `compiles_ahead`, `compile_ahead_s`."""

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self.ahead_count = 0
        self.ahead_seconds = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._heard)

    def _heard(self, event: str, duration: float, **_: Any) -> None:
        if event != COMPILE_EVENT:
            return
        # the listener runs on the thread that compiled
        if threading.current_thread().name.startswith(AHEAD_THREAD):
            self.ahead_count += 1
            self.ahead_seconds += duration
        else:
            self.count += 1
            self.seconds += duration

    def read(self) -> dict[str, Any]:
        return {
            "compiles": self.count,
            "compile_s": round(self.seconds, 3),
            "compiles_ahead": self.ahead_count,
            "compile_ahead_s": round(self.ahead_seconds, 3),
        }

    def close(self) -> None:
        jax.monitoring.unregister_event_duration_listener(self._heard)


class StoreMeter:
    """The store's counters for the log without waiting for the shards: each read asks
    for fresh counters and returns the latest answer at hand (the previous request's,
    at most one log interval old), or waits for the fresh ones when `wait`."""

    def __init__(self, store: Any):
        self._store = store
        self._pending = store.stats_async()
        self._latest: dict[str, Any] = {}

    def read(self, *, wait: bool = False) -> dict[str, Any]:
        if wait or not self._latest or self._pending.done():
            self._latest = self._pending.result()
        if self._pending.done():
            self._pending = self._store.stats_async()
        return self._latest


class IntervalMeter:
    """Loss, throughput and staleness over one logging interval (losses stay on the
    devices until the interval ends, so logging never stalls a step: a flush takes the
    losses of the steps already done and leaves the rest to the next interval)."""

    def __init__(self, samples_done: int = 0):
        self.last_loss = float("nan")
        self.samples_done = samples_done  # samples of the steps whose loss has been fetched
        self._losses: list[tuple[jax.Array, int]] = []  # (loss, samples) of steps not fetched
        self._start_interval()

    def _start_interval(self) -> None:
        self._staleness: list[int] = []
        self._samples = 0
        self._start = time.perf_counter()
        self._paused_seconds = 0.0

    def add(self, result: StepResult, samples: int) -> None:
        self._losses.append((result.metrics["loss"], samples))
        self._staleness.append(result.staleness)
        self._samples += samples

    def flush(self, step: int, timings: dict[str, float], *, wait: bool = False) -> dict[str, Any]:
        """The interval's record (raises model.NonFiniteLossError on a non-finite loss).

        Without `wait`, the losses of steps still running move to the next interval
        (the oldest one is waited for when none is done yet).
        """
        done = len(self._losses)
        if not wait:
            done = next(
                (i for i, (loss, _) in enumerate(self._losses) if not loss.is_ready()), done
            )
            done = max(done, 1)
        finished, self._losses = self._losses[:done], self._losses[done:]
        losses = np.asarray(jax.device_get([loss for loss, _ in finished]), np.float64)
        self.samples_done += sum(samples for _, samples in finished)
        check_finite_losses(losses, step)
        seconds = time.perf_counter() - self._start - self._paused_seconds
        self.last_loss = float(losses.mean())
        record = {
            "loss": self.last_loss,
            "samples_per_s": self._samples / max(seconds, 1e-9),
            "staleness_mean": float(np.mean(self._staleness)),
            "staleness_max": int(np.max(self._staleness)),
            # steps finish behind their dispatch: what was trained by the time of this record
            "samples_done": self.samples_done,
            "seconds": seconds,
            **timings,
        }
        self._start_interval()
        return record

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A context whose time does not count as training time."""
        since = time.perf_counter()
        try:
            yield
        finally:
            self._paused_seconds += time.perf_counter() - since
