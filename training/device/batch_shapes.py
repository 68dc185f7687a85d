"""The sizes the device tables' batch arrays are padded to.

Every distinct set of shapes compiles the train step again: about a quarter of a second
for the `criteo_dlrm` step on two CPU cores, seconds for the MLPerf shape on a GPU. The
sizes are powers of two, so a table hovering about one size compiles once. A size that
follows the batches both ways (a batch's new rows: tens of thousands while the tables
fill, a few hundred once they have) would compile at every power of two it crosses
downwards; `PaddedSizes.fit` shrinks only when the padding carried since a batch last
needed the whole size has cost more than a compile is worth (`WASTE_BYTES`), and then to
what the last batches needed (a size seen before, should it grow back, is compiled
already).

A shrink's compile need not stall training: with an `ahead` hook, the smaller size is
announced when it is chosen and taken `SHRINK_DELAY` batches later, while the hook
compiles the step for it on a worker (`training.hybrid.HybridLoop`). The delay counts
batches, not seconds, so every process of a run switches at the same batch.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax

# padding bytes a size carries before it shrinks: at 5-20 GB/s of host copies and
# transfers, a few tenths of a second, about what the step's compile costs
WASTE_BYTES = 2 << 30
# batches between choosing a smaller size and taking it, when a hook compiles it ahead:
# about a second of a GPU host's batches, more than the step's compile on two CPU cores
SHRINK_DELAY = 64
WINDOW = 32  # the batches whose largest need a size comes down to
AHEAD_THREAD = "hybridrec-compile"  # the name of the thread that compiles ahead


def bucket(size: int) -> int:
    """The power of two at or above `size` (1 for 0)."""
    return 1 << (max(int(size), 1) - 1).bit_length()


@dataclasses.dataclass
class _Fitted:
    size: int
    waste: int = 0  # padding bytes carried since a batch last needed the whole size
    recent: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=WINDOW)
    )  # the sizes the last batches needed
    pending: int = 0  # a smaller size announced, taken once `countdown` batches have passed
    countdown: int = 0
    compiled: Future | None = None  # what `ahead` returned for it


class PaddedSizes:
    """Per key, the power of two batches are padded to.

    ahead: called as `ahead(key, size)` when `fit` chooses a smaller size for `key`, which
    it then takes `delay` batches later (None: at once); what it returns (the compile for
    that size) is handed to the batch that takes the size (`compiled`).
    """

    def __init__(
        self,
        waste_bytes: int | None = None,
        *,
        ahead: Callable[[str, int], Future | None] | None = None,
        delay: int | None = None,
    ):
        self.waste_bytes = WASTE_BYTES if waste_bytes is None else waste_bytes
        self.ahead = ahead
        self.delay = SHRINK_DELAY if delay is None else delay
        self._grown: dict[str, int] = {}
        self._fitted: dict[str, _Fitted] = {}
        self._taken: dict[str, Future | None] = {}  # key -> the compile of the size just taken

    def grow(self, key: str, need: int) -> int:
        """A size for `need` entries that never shrinks: `need` bucketed, or the larger size
        `key` had before."""
        size = max(self._grown.get(key, 0), bucket(need))
        self._grown[key] = size
        return size

    def fit(self, key: str, need: int, entry_bytes: int) -> int:
        """A size for `need` entries of `entry_bytes` each. It grows at once; once the
        padding carried since a batch last needed the whole size passes `waste_bytes`, it
        comes down to the largest size the last `WINDOW` batches needed (with `ahead`:
        announced, and taken `delay` batches later unless a batch needs more before)."""
        size = bucket(need)
        fitted = self._fitted.get(key)
        if fitted is None or size > fitted.size:
            self._fitted[key] = _Fitted(size)
            return size
        if fitted.pending:
            if size <= fitted.pending:
                fitted.countdown -= 1
                if fitted.countdown <= 0:
                    self._fitted[key] = _Fitted(fitted.pending)
                    self._taken[key] = fitted.compiled
                return self._fitted[key].size
            fitted.pending = fitted.countdown = 0  # the smaller size no longer holds them
        fitted.recent.append(size)
        if size == fitted.size:  # the whole size in use: no padding
            fitted.waste = 0
            return size
        fitted.waste += (fitted.size - size) * entry_bytes
        smaller = max(fitted.recent)
        if fitted.waste > self.waste_bytes and smaller < fitted.size:
            if self.ahead is None or self.delay <= 0:
                self._fitted[key] = _Fitted(smaller)
            else:
                fitted.pending, fitted.countdown = smaller, self.delay
                fitted.compiled = self.ahead(key, smaller)
        return self._fitted[key].size

    def compiled(self, key: str) -> Future | None:
        """The compile `ahead` started for the size `fit` just took for `key` (else None)."""
        return self._taken.pop(key, None)


class AheadCompiler:
    """Compiles a jitted step for batch shapes still to come, on a worker thread, so that the
    batch which brings them finds the step compiled (JAX's cache holds what `lower(...)
    .compile()` built; a call with those shapes reuses it).

    `saw(state, batch)` with each step's arguments keeps them (the batch's arrays until
    the next step's; a donated state's deleted buffers still tell their shapes);
    `compiler({array key: shape})` compiles the step for the last batch's arrays with
    those keys' shapes changed and returns the Future of it (None before any step), True
    once compiled. A compile that fails here (False) is left to the call that needs it,
    which compiles again and raises what is wrong.
    """

    def __init__(self, step: Any):
        self._step = step
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=AHEAD_THREAD)
        self._args: tuple[Any, Mapping[str, Any]] | None = None

    def saw(self, state: Any, batch: Mapping[str, Any]) -> None:
        self._args = (state, batch)

    def __call__(self, shapes: Mapping[str, tuple[int, ...]]) -> Future | None:
        args = self._args
        if args is None:  # no step yet, or closed
            return None
        try:
            return self._pool.submit(self._compile, *args, dict(shapes))
        except RuntimeError:  # closed meanwhile
            return None

    def _compile(self, state, batch, shapes) -> bool:
        def spec(x, shape=None):  # an uncommitted array goes where the step puts it
            if not isinstance(x, jax.Array):
                return x
            sharding = x.sharding if getattr(x, "committed", True) else None
            return jax.ShapeDtypeStruct(shape or x.shape, x.dtype, sharding=sharding)

        batch = {key: spec(array, shapes.get(key)) for key, array in batch.items()}
        try:
            self._step.lower(jax.tree.map(spec, state), batch).compile()
        except Exception as error:  # noqa: BLE001 - the step's own call raises it
            print(f"compiling ahead for {shapes}: {error}", file=sys.stderr, flush=True)
            return False
        return True

    def close(self) -> None:
        """Drops the arguments kept (and the batch's arrays with them) and what is queued;
        a compile under way ends on its own."""
        self._args = None
        self._pool.shutdown(wait=False, cancel_futures=True)
