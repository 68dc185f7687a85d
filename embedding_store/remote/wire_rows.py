"""Whole rows on the wire: rows with their optimizer state, always float32.

The tables and hot-row caches trained on a trainer's devices take rows from the shard
servers and write them back (`write_rows`, `take_rows`, `read_rows`; the operations
are described in `wire`). Their rows travel as

    ROWS_SCHEMA    {ids: uint64, values: list<float32>, state: list<float32>}

batches named by table in their `app_metadata`, each list exactly the table's dim and
optimizer-state width long, at most ROWS_PER_BATCH rows a batch (a table's rows may
span several).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import pyarrow as pa
from hybridrec.embedding_store.remote import wire

ROWS_PER_BATCH = 1 << 16
_FLOATS = pa.list_(pa.field("item", pa.float32(), nullable=False))
ROWS_SCHEMA = pa.schema(
    [
        pa.field("ids", pa.uint64(), nullable=False),
        pa.field("values", _FLOATS, nullable=False),
        pa.field("state", _FLOATS, nullable=False),
    ]
)


def _lists(flat: np.ndarray, n: int, width: int) -> pa.ListArray:
    """[n * width] float32 -> n lists of `width` (no copy of the values)."""
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * np.int32(width))
    return pa.ListArray.from_arrays(offsets, pa.array(flat, type=pa.float32()))


def rows_batches(
    rows: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> Iterable[tuple[pa.RecordBatch, bytes]]:
    """Yields (record batch, table name) of whole rows: table -> (ids [n] uint64, values
    [n, dim] float32, optimizer state [n, width] float32), ROWS_PER_BATCH rows a batch
    (a table with no rows still sends one empty batch)."""
    for table, (ids, values, state) in rows.items():
        ids = np.ascontiguousarray(wire.check_ids(ids, f"table {table!r}"))
        values = np.ascontiguousarray(values, dtype=np.float32)
        state = np.ascontiguousarray(state, dtype=np.float32)
        n = len(ids)
        if values.ndim != 2 or state.ndim != 2 or values.shape[0] != n or state.shape[0] != n:
            raise wire.WireError(
                f"table {table!r}: rows must be [{n}, dim] values and [{n}, width] state, "
                f"got {values.shape} and {state.shape}"
            )
        for start in range(0, max(n, 1), ROWS_PER_BATCH):
            end = min(start + ROWS_PER_BATCH, n)
            columns = [
                pa.array(ids[start:end], type=pa.uint64()),
                _lists(values[start:end].reshape(-1), end - start, values.shape[1]),
                _lists(state[start:end].reshape(-1), end - start, state.shape[1]),
            ]
            yield pa.record_batch(columns, schema=ROWS_SCHEMA), table.encode()


def _fixed_lists(lists: pa.Array, n: int, width: int, where: str) -> np.ndarray:
    """n lists each exactly `width` long -> [n, width] float32 (a view)."""
    if lists.null_count:
        raise wire.WireError(f"{where}: nulls are not allowed")
    offsets = lists.offsets.to_numpy(zero_copy_only=True)
    expected = np.int64(offsets[0]) + np.arange(n + 1, dtype=np.int64) * width
    if offsets.shape != expected.shape or not np.array_equal(offsets, expected):
        raise wire.WireError(f"{where}: every row must have {width} values")
    return wire.from_wire(lists.values.slice(int(offsets[0]), n * width), "float32", where).reshape(
        n, width
    )


def decode_rows(
    chunks: Iterable[tuple[pa.RecordBatch, pa.Buffer | None]],
    schema: pa.Schema,
    shapes: Mapping[str, tuple[int, int]],
    limits: wire.RequestLimits | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Reads a whole-rows stream (`rows_batches`) into table -> (ids [n] uint64, values
    [n, dim], state [n, width]) float32, validated against `shapes` {table: (dim, width)};
    a table's batches are joined in order."""
    if not schema.equals(ROWS_SCHEMA):
        raise wire.WireError(f"rows schema must be {ROWS_SCHEMA}, got {schema}")
    parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for batch, metadata in chunks:
        table = wire.table_name(metadata, shapes, set())
        if limits is not None:
            limits.charge(batch.num_rows, batch.nbytes)
        dim, width = shapes[table]
        n = batch.num_rows
        parts.setdefault(table, []).append(
            (
                wire.column_numpy(batch.column(0), np.uint64, f"table {table!r} ids"),
                _fixed_lists(batch.column(1), n, dim, f"table {table!r} values"),
                _fixed_lists(batch.column(2), n, width, f"table {table!r} state"),
            )
        )
    return {
        table: tuple(np.concatenate([part[i] for part in pieces]) for i in range(3))
        for table, pieces in parts.items()
    }
