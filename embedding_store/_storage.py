"""Where a shard's rows live: all in RAM, or hot rows in RAM over a tensorstore cold tier.

The cold tier is a zarr3 array [rows, dim + state] float32 on an OCDBT kvstore
(local disk by default; any kvstore URL works), written as an append-only log.

Both backends expose the same small interface to the table: `lines(slots)` gives
indices into `values`/`state` (RAM arrays) for the rows about to be read or
updated. In RAM that is the identity. When tiered, missing rows are fetched from
the cold zarr3 array in one bulk read, and when RAM is full the least recently used
rows are evicted in one bulk round, dirty ones written back in one write: chunked
writes never happen row by row on the step path.
"""

from __future__ import annotations

import shutil
import tempfile

import ml_dtypes
import numpy as np
import tensorstore as ts
from hybridrec.embedding_store._arrays import put_rows, take_rows
from hybridrec.embedding_store._growth import Spare
from hybridrec.embedding_store._kvstore import kvstore_spec
from hybridrec.embedding_store.errors import EmbeddingStoreError

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class RamRows:
    """Every row in RAM: values [slots, dim] (storage dtype), state [slots, width] float32."""

    tiered = False

    def __init__(self, dim: int, state_width: int, dtype: str, initial_rows: int):
        self.values = np.zeros((initial_rows, dim), DTYPES[dtype])
        self.state = np.zeros((initial_rows, state_width), np.float32)
        self._spares = (Spare(), Spare())

    def prepare(self, slots: int) -> None:
        """Starts allocating room for `slots` slots in the background (see `_growth`)."""
        self._spares[0].prepare(self.values, slots)
        self._spares[1].prepare(self.state, slots)

    def reserve(self, slots: int) -> None:
        """Room for `slots` slots: the arrays grow, keeping their rows."""
        self.values = self._spares[0].grow(self.values, slots)
        self.state = self._spares[1].grow(self.state, slots)

    def lines(self, slots: np.ndarray, protect: np.ndarray | None = None) -> np.ndarray:
        return slots

    def gather(self, slots: np.ndarray) -> np.ndarray:
        """Rows of `slots` as float32 [n, dim]."""
        return take_rows(self.values, slots).astype(np.float32, copy=False)

    def mark_dirty(self, lines: np.ndarray) -> None:
        pass

    def write_rows(self, slots: np.ndarray, values: np.ndarray, state: np.ndarray) -> None:
        put_rows(self.values, slots, values)
        put_rows(self.state, slots, state)

    def read_rows(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return take_rows(self.values, slots).astype(np.float32), take_rows(self.state, slots)

    def release(self, slots: np.ndarray) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {"bytes_held": self.values.nbytes + self.state.nbytes}

    def bytes_at(self, slots: int) -> int:
        """The bytes of the arrays grown to `slots` rows."""
        return slots * (self.values.itemsize * self.values.shape[1] + 4 * self.state.shape[1])

    def close(self) -> None:
        pass


class TieredRows:
    """`ram_rows` hot rows in RAM over a log-structured cold tier (zarr3 on OCDBT).

    Evicted dirty rows are appended to the cold array as one contiguous block (whole
    chunks, no read-modify-write of old chunks); each slot remembers where its latest
    cold copy is. When the log is full, live cold rows are copied, in position order,
    into a fresh array (at most once per `max_slots` appended rows).
    """

    tiered = True

    def __init__(
        self,
        dim: int,
        state_width: int,
        dtype: str,
        *,
        ram_rows: int,
        max_slots: int,
        location: str,
        chunk_rows: int,
        evict_fraction: float,
        context: ts.Context,
    ):
        self._dim = dim
        self._width = dim + state_width
        self._ram_rows = ram_rows
        self._evict_batch = max(1, int(ram_rows * evict_fraction))
        self.values = np.zeros((ram_rows, dim), DTYPES[dtype])
        self.state = np.zeros((ram_rows, state_width), np.float32)
        self._slot_of_line = np.full(ram_rows, -1, np.int64)
        self._line_tick = np.zeros(ram_rows, np.int64)
        self._dirty = np.zeros(ram_rows, bool)
        self._free_lines = np.arange(ram_rows - 1, -1, -1, dtype=np.int64)  # stack
        self._line_of_slot = np.full(1024, -1, np.int64)
        self._cold_row = np.full(1024, -1, np.int64)  # position of a slot's cold copy
        self._spares = (Spare(), Spare())
        self._tick = 1
        self._counts = {"cold_reads": 0, "cold_writes": 0, "ram_evictions": 0, "compactions": 0}
        self._temporary = None
        if not location:
            self._temporary = tempfile.mkdtemp(prefix="hybridrec-cold-")
            location = self._temporary
        self._location = location
        self._context = context
        self._chunk = max(1, min(chunk_rows, max_slots))
        # Room for every slot twice over (plus chunk alignment): compaction is rare.
        self._log_rows = 2 * (max_slots + self._evict_batch) + 2 * self._chunk
        self._generation = 0
        self._log_end = 0
        self._cold = self._open_log()

    def _open_log(self) -> ts.TensorStore:
        return ts.open(
            {
                "driver": "zarr3",
                # OCDBT packs chunk writes into large append-only files.
                "kvstore": {
                    "driver": "ocdbt",
                    "base": kvstore_spec(self._location, f"log-{self._generation % 2}"),
                },
                "metadata": {
                    "shape": [self._log_rows, self._width],
                    "data_type": "float32",
                    "chunk_grid": {
                        "name": "regular",
                        "configuration": {"chunk_shape": [self._chunk, self._width]},
                    },
                },
            },
            create=True,
            delete_existing=True,
            context=self._context,
        ).result()

    def prepare(self, slots: int) -> None:
        """Starts allocating room for `slots` slots in the background (see `_growth`)."""
        self._spares[0].prepare(self._line_of_slot, slots, -1)
        self._spares[1].prepare(self._cold_row, slots, -1)

    def reserve(self, slots: int) -> None:
        """Room for `slots` slots (the RAM tier itself has a fixed size)."""
        self._line_of_slot = self._spares[0].grow(self._line_of_slot, slots, -1)
        self._cold_row = self._spares[1].grow(self._cold_row, slots, -1)

    def _read_cold(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows at cold positions [m] -> (block [m, width] in the given order)."""
        order = np.argsort(positions)  # chunk-local reads
        block = np.empty((len(positions), self._width), np.float32)
        block[order] = self._cold[positions[order]].read().result()
        self._counts["cold_reads"] += len(positions)
        return block

    def lines(self, slots: np.ndarray, protect: np.ndarray | None = None) -> np.ndarray:
        lines = self._line_of_slot[slots]
        hot = lines >= 0
        self._line_tick[lines[hot]] = self._tick
        if protect is not None:
            protected = self._line_of_slot[protect]
            self._line_tick[protected[protected >= 0]] = self._tick
        if not hot.all():
            missing = _sorted_unique(slots[~hot])
            free = self._take_lines(len(missing))
            self._slot_of_line[free] = missing
            self._line_of_slot[missing] = free
            self._line_tick[free] = self._tick
            self._dirty[free] = False
            positions = self._cold_row[missing]
            cold = positions >= 0
            if cold.any():
                # One bulk read for every miss of the call.
                block = self._read_cold(positions[cold])
                put_rows(self.values, free[cold], block[:, : self._dim])
                put_rows(self.state, free[cold], block[:, self._dim :])
            lines = self._line_of_slot[slots]
        self._tick += 1
        return lines

    def gather(self, slots: np.ndarray) -> np.ndarray:
        """Rows of `slots` as float32 [n, dim]; cached in RAM when they fit the budget."""
        if len(slots) > self._ram_rows and len(_sorted_unique(slots)) > self._ram_rows:
            return self.read_rows(slots)[0]  # a scan larger than RAM (evaluation): no caching
        return take_rows(self.values, self.lines(slots)).astype(np.float32, copy=False)

    def _take_lines(self, count: int) -> np.ndarray:
        if count > self._ram_rows:
            raise EmbeddingStoreError(
                f"one request needs {count} distinct rows in RAM but the shard's tiering.ram_rows "
                f"budget is {self._ram_rows}; raise tiering.ram_rows or use smaller batches"
            )
        if len(self._free_lines) < count:
            self._evict(max(count - len(self._free_lines), self._evict_batch))
        if len(self._free_lines) < count:  # the rest of the RAM tier serves this same request
            raise EmbeddingStoreError(
                f"one request needs more distinct rows in RAM than the shard's tiering.ram_rows "
                f"budget of {self._ram_rows}; raise tiering.ram_rows or use smaller batches"
            )
        taken = self._free_lines[len(self._free_lines) - count :]
        self._free_lines = self._free_lines[: len(self._free_lines) - count]
        return taken[::-1].copy()

    def _evict(self, count: int) -> None:
        occupied = np.flatnonzero(self._slot_of_line >= 0)
        ticks = self._line_tick[occupied]
        # Lines touched by the current call carry the current tick: never evict those.
        candidates = occupied[ticks < self._tick]
        count = min(count, len(candidates))
        victims = candidates[
            np.argpartition(self._line_tick[candidates], count - 1)[:count]
            if count < len(candidates)
            else slice(None)
        ]
        self._write_back(victims[self._dirty[victims]])
        slots = self._slot_of_line[victims]
        self._line_of_slot[slots] = -1
        self._slot_of_line[victims] = -1
        self._free_lines = np.concatenate([self._free_lines, victims])
        self._counts["ram_evictions"] += len(victims)

    def _write_back(self, lines: np.ndarray) -> None:
        """Appends the rows of `lines` to the log as one contiguous block."""
        if not len(lines):
            return
        if self._log_end + len(lines) > self._log_rows:
            self._compact()
        slots = self._slot_of_line[lines]
        block = np.concatenate(
            [take_rows(self.values, lines).astype(np.float32), take_rows(self.state, lines)],
            axis=1,
        )
        start = self._log_end
        self._cold[start : start + len(lines)].write(block).result()
        self._cold_row[slots] = np.arange(start, start + len(lines))
        # The next block starts on a chunk boundary: no chunk is ever written twice.
        self._log_end = -(-(start + len(lines)) // self._chunk) * self._chunk
        self._dirty[lines] = False
        self._counts["cold_writes"] += len(lines)

    def _compact(self) -> None:
        """Copies the live cold rows into a fresh log, in position order, in bulk blocks."""
        live = np.flatnonzero(self._cold_row >= 0)
        live = live[np.argsort(self._cold_row[live])]
        old = self._cold
        self._generation += 1
        self._cold = self._open_log()
        step = max(self._chunk, 1 << 20)
        for start in range(0, len(live), step):
            slots = live[start : start + step]
            block = old[self._cold_row[slots]].read().result()
            self._cold[start : start + len(slots)].write(block).result()
            self._cold_row[slots] = np.arange(start, start + len(slots))
        self._log_end = -(-len(live) // self._chunk) * self._chunk
        self._counts["compactions"] += 1

    def mark_dirty(self, lines: np.ndarray) -> None:
        self._dirty[lines] = True

    def write_rows(self, slots: np.ndarray, values: np.ndarray, state: np.ndarray) -> None:
        lines = self.lines(slots)
        put_rows(self.values, lines, values)
        put_rows(self.state, lines, state)
        self._dirty[lines] = True

    def read_rows(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Reads rows without moving them into RAM (checkpoints read everything)."""
        values = np.zeros((len(slots), self._dim), np.float32)
        state = np.zeros((len(slots), self.state.shape[1]), np.float32)
        lines = self._line_of_slot[slots]
        hot = lines >= 0
        values[hot] = take_rows(self.values, lines[hot])
        state[hot] = take_rows(self.state, lines[hot])
        cold = ~hot & (self._cold_row[slots] >= 0)
        if cold.any():
            block = self._read_cold(self._cold_row[slots[cold]])
            values[cold] = block[:, : self._dim]
            state[cold] = block[:, self._dim :]
        return values, state

    def release(self, slots: np.ndarray) -> None:
        lines = self._line_of_slot[slots]
        lines = lines[lines >= 0]
        self._slot_of_line[lines] = -1
        self._dirty[lines] = False
        self._free_lines = np.concatenate([self._free_lines, lines])
        self._line_of_slot[slots] = -1
        self._cold_row[slots] = -1

    def stats(self) -> dict[str, int]:
        return {
            "bytes_held": self.values.nbytes
            + self.state.nbytes
            + self._line_of_slot.nbytes
            + self._cold_row.nbytes,
            "ram_rows": self._ram_rows,
            "hot_rows": int(self._ram_rows - len(self._free_lines)),
            **self._counts,
        }

    def bytes_at(self, slots: int) -> int:
        """The bytes held with `slots` slots: the RAM tier is allocated up front."""
        return self.values.nbytes + self.state.nbytes + 16 * slots

    def close(self) -> None:
        if self._temporary:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    ordered = np.sort(values)
    if len(ordered) < 2:
        return ordered
    return ordered[np.concatenate([[True], ordered[1:] != ordered[:-1]])]
