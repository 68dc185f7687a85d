"""What the event-log job reads besides the log's blocks: Parquet schemas and batches, the
items file, and where a chunk-local line sits in its file (for messages)."""

from __future__ import annotations

import os
import threading
import weakref

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems
from hybridrec.pipeline import _chunks, _parquet, hashing
from hybridrec.pipeline._errors import InputError
from hybridrec.pipeline.events._event_parse import Cells, ids_of
from hybridrec.pipeline.events._histories import IdIndex, ItemFeatures
from hybridrec.pipeline.events.event_spec import EventSpec


class Where:
    """Names a chunk-local line as "FILE: line N" (Parquet: "FILE: row N"), counting the
    lines of the file before the chunk only when a message needs them."""

    def __init__(self, chunk: _chunks.Chunk):
        self.chunk = chunk
        self.before: int | None = None

    def __call__(self, local: int) -> str:
        if self.before is None:
            self.before = lines_before(self.chunk)
        if self.chunk.format == "parquet":
            return f"{self.chunk.path}: row {self.before + local}"
        return f"{self.chunk.path}: line {self.before + local + 1}"


def lines_before(chunk: _chunks.Chunk) -> int:
    """Lines (Parquet: rows) of the chunk's file before the chunk."""
    if chunk.chunk_index == 0:
        return 0
    if chunk.format == "parquet":
        with _parquet.open_file(chunk.path) as parquet_file:
            return sum(parquet_file.metadata.row_group(g).num_rows for g in range(chunk.start))
    with FileSystems.open(chunk.path) as handle:
        data = handle.read(chunk.start)
    # a line crossing the chunk's start belongs to the chunk before
    return data.count(b"\n") + (not data.endswith(b"\n"))


def event_batches(chunk: _chunks.Chunk, spec: EventSpec, batch_rows: int):
    columns = event_columns(spec)
    with _parquet.open_file(chunk.path) as parquet_file:
        check_event_schema(parquet_file.schema_arrow, spec, chunk.path)
        if chunk.end > chunk.start:
            yield from parquet_file.iter_batches(
                batch_size=batch_rows, row_groups=range(chunk.start, chunk.end), columns=columns
            )


def event_columns(spec: EventSpec) -> list[str]:
    names = [spec.user, spec.item]
    names += [spec.time] if spec.time else []
    names += [spec.action.column] if spec.action else []
    return names + [feature.name for feature in spec.event_features]


def check_event_schema(schema: pa.Schema, spec: EventSpec, path: str) -> None:
    """Every column the spec uses is in the file once, and not a list or a struct.

    Raises:
        InputError: naming the file and the column.
    """
    for name in event_columns(spec):
        count = schema.names.count(name)
        if count != 1:
            problem = "is missing" if count == 0 else f"appears {count} times"
            raise InputError(
                f"{path}: column {name!r} of spec {spec.name!r} {problem}; a Parquet input's "
                f"column names must be the spec's (file columns: {', '.join(schema.names[:40])})"
            )
        kind = schema.field(name).type
        if pa.types.is_nested(kind):
            raise InputError(f"{path}: column {name!r} has type {kind}; it must hold one value")


def load_item_features(spec: EventSpec) -> ItemFeatures:
    """The item features file: its item ids and each feature's ids, sorted by item.

    Raises:
        InputError: the file cannot be read, lacks a column, or repeats an item.
    """
    items = spec.items
    path = items.path
    try:
        if _parquet.is_parquet(path):
            table = pq.read_table(path, columns=[items.id, *items.features])
            table = table.cast(pa.schema([(name, pa.string()) for name in table.column_names]))
        else:
            names = [items.id, *items.features]
            options = pa_csv.ConvertOptions(
                column_types={name: pa.string() for name in names}, include_columns=names
            )
            parse = pa_csv.ParseOptions(delimiter=items.delimiter)
            table = pa_csv.read_csv(path, parse_options=parse, convert_options=options)
    except (OSError, pa.ArrowException, KeyError) as error:
        raise InputError(
            f"items file {path}: cannot read {items.id} and {list(items.features)}: {error}"
        ) from None
    bits = spec.prefix_bits

    def ids(name: str, table_name: str) -> np.ndarray:
        column = table.column(name).combine_chunks().cast(pa.large_binary())
        return ids_of(Cells.of_binary(column), spec.prefix(table_name), bits)

    item_ids = ids(items.id, "item")
    order = np.argsort(item_ids, kind="stable")
    sorted_items = item_ids[order]
    repeated = np.flatnonzero(sorted_items[1:] == sorted_items[:-1])
    if len(repeated):
        row = int(order[repeated[0] + 1])
        raise InputError(
            f"items file {path}: row {row + 2}: item {table.column(items.id)[row]} is listed "
            "twice; one row an item"
        )
    return ItemFeatures(
        items=sorted_items,
        ids={name: ids(name, name)[order] for name in items.features},
        missing={name: hashing.missing_id(spec.prefix(name), bits) for name in items.features},
    )


_shared_lock = threading.Lock()
_shared: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def shared_item_features(spec: EventSpec) -> ItemFeatures:
    """`load_item_features` once per process while a caller holds the result: the
    DirectRunner's workers are threads of one process, and each would otherwise hold its
    own copy of the items' ids, features and index (at 10M items, about 0.5 GB each).
    Keyed by the file's path, size and modification time and the spec's items section;
    the id index is built here, under the lock, so the threads only read it.

    Raises:
        InputError: as `load_item_features`.
    """
    path = spec.items.path
    try:
        status = os.stat(path) if "://" not in path else None
    except OSError:
        status = None  # load_item_features names the problem
    stamp = (status.st_size, status.st_mtime_ns) if status else None
    key = (path, stamp, repr(spec.items), spec.prefix_bits)
    with _shared_lock:
        features = _shared.get(key) if stamp else None
        if features is None:
            features = load_item_features(spec)
            if len(features.items):
                features.index = IdIndex(features.items)
            if stamp:
                _shared[key] = features
        return features
