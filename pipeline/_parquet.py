"""Parquet input: schema checks, row-group chunks, and vectorized parsing of record batches.

A Parquet input is read with the same spec as a text log: its columns are matched
by name (a file's column names must be the spec's column names; other columns are
ignored). Every value is turned into what the text path would see, so a Parquet
row yields exactly the ids, dense values and label of the equivalent text row:

- categorical strings are hashed as their UTF-8 bytes (binary columns: their bytes);
  categorical integers as their decimal text (`123`, `-5`: no sign for positive
  values, no leading zeros), which is what the hash of the text field `123` is;
- dense integers are exact (what the text path parses from `123`), dense floats are
  used as float64; dense strings go through the text parser itself;
- nulls and empty strings are missing, like empty text fields;
- multi-valued features are list columns (each element one value; a null element,
  an empty list and a null list are the missing value, like an empty text field) or
  strings joined by the feature's separator.

Each record batch is parsed with numpy/pyarrow over whole columns; only rejected
rows are looked at one by one (to write them to the rejected-rows file).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from hybridrec.pipeline import hashing
from hybridrec.pipeline._errors import InputError
from hybridrec.pipeline._parse import (
    REASON_CODE,
    REASONS,
    ParsedBlock,
    hash_binary_array,
    output_schema,
    parse_floats,
    parse_ints,
    split_multi_valued_ids,
    transform_dense,
)
from hybridrec.pipeline.spec import FeatureSpec

PARQUET_SUFFIXES = (".parquet", ".pq")
_INT64_LIMIT = 2.0**63  # floats at or beyond this magnitude are outside int64
_ACCEPTED = {  # column role -> accepted kinds (see `_kind`)
    "label": ("bool", "integer", "float", "string"),
    "dense": ("null", "integer", "float", "string"),
    "categorical": ("null", "integer", "string"),
    "multi-valued categorical": (
        "null",
        "integer",
        "string",
        "list<null>",
        "list<integer>",
        "list<string>",
    ),
}
_DESCRIBE = {
    "label": "boolean, integer, float or string",
    "dense": "integer, float or string",
    "categorical": "integer or string",
    "multi-valued categorical": "a list of integers or strings, or a separator-joined string",
}


def is_parquet(path: str, input_format: str = "auto") -> bool:
    """Whether `path` is read as Parquet: by `input_format`, or by its extension for `auto`."""
    if input_format == "auto":
        return path.lower().endswith(PARQUET_SUFFIXES)
    return input_format == "parquet"


def _kind(data_type: pa.DataType) -> str:
    if pa.types.is_dictionary(data_type):
        return _kind(data_type.value_type)
    if pa.types.is_null(data_type):
        return "null"
    if pa.types.is_boolean(data_type):
        return "bool"
    if pa.types.is_integer(data_type):
        return "integer"
    if pa.types.is_floating(data_type):
        return "float"
    if (
        pa.types.is_string(data_type)
        or pa.types.is_large_string(data_type)
        or pa.types.is_string_view(data_type)
        or pa.types.is_binary(data_type)
        or pa.types.is_large_binary(data_type)
        or pa.types.is_binary_view(data_type)
    ):
        return "string"
    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type):
        inner = _kind(data_type.value_type)
        return f"list<{inner}>" if inner in ("null", "integer", "string") else "list<other>"
    return "other"


def _roles(spec: FeatureSpec) -> list[tuple[str, str]]:
    roles = [(spec.label, "label"), *((name, "dense") for name in spec.dense)]
    for feature in spec.categorical:
        role = "multi-valued categorical" if feature.multi_valued else "categorical"
        roles.append((feature.name, role))
    return roles


def check_schema(schema: pa.Schema, spec: FeatureSpec, path: str) -> None:
    """Checks that every column the spec uses is present once, with an accepted type.

    Raises:
        InputError: naming the file and the column.
    """
    names = schema.names
    for name, role in _roles(spec):
        count = names.count(name)
        if count == 0:
            shown = ", ".join(names[:60]) + (", ..." if len(names) > 60 else "")
            raise InputError(
                f"{path}: column {name!r} ({role} of spec {spec.name!r}) is missing; a Parquet "
                f"input's column names must be the spec's column names (file columns: {shown})"
            )
        if count > 1:
            raise InputError(f"{path}: column {name!r} appears {count} times")
        data_type = schema.field(name).type
        if _kind(data_type) not in _ACCEPTED[role]:
            raise InputError(
                f"{path}: column {name!r} has type {data_type}; a {role} column must be "
                f"{_DESCRIBE[role]}"
            )


@contextlib.contextmanager
def open_file(path: str) -> Iterator[pq.ParquetFile]:
    """Opens a local or remote (any Beam filesystem) Parquet file.

    Raises:
        InputError: the file cannot be read or is not a valid Parquet file.
    """
    handle = None
    try:
        try:
            if "://" in path:
                handle = FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)
                parquet_file = pq.ParquetFile(handle, page_checksum_verification=True)
            else:
                parquet_file = pq.ParquetFile(path, page_checksum_verification=True)
        except (OSError, ValueError, pa.ArrowException) as error:
            raise InputError(
                f"{path}: not a readable Parquet file ({error}); re-download or remove the file"
            ) from None
        with contextlib.closing(parquet_file):
            yield parquet_file
    finally:
        if handle is not None:
            handle.close()


def row_group_chunks(
    path: str, spec: FeatureSpec | None, chunk_bytes: int
) -> list[tuple[int, int, int, int]]:
    """Groups consecutive row groups into chunks of about `chunk_bytes` (compressed).

    Reads only the footer; checks the schema against `spec` (when given).

    Returns:
        [(first row group, end row group (exclusive), rows, compressed bytes)], at least one.

    Raises:
        InputError: unreadable or corrupt file, missing column, unaccepted column type.
    """
    with open_file(path) as parquet_file:
        if spec is not None:
            check_schema(parquet_file.schema_arrow, spec, path)
        meta = parquet_file.metadata
        groups = []
        for index in range(meta.num_row_groups):
            group = meta.row_group(index)
            compressed = sum(
                group.column(c).total_compressed_size for c in range(group.num_columns)
            )
            groups.append((group.num_rows, compressed))
    chunks: list[tuple[int, int, int, int]] = []
    start, rows, size = 0, 0, 0
    for index, (group_rows, group_bytes) in enumerate(groups):
        rows, size = rows + group_rows, size + group_bytes
        if size >= chunk_bytes or index == len(groups) - 1:
            chunks.append((start, index + 1, rows, size))
            start, rows, size = index + 1, 0, 0
    return chunks or [(0, 0, 0, 0)]


def read_batches(
    path: str,
    spec: FeatureSpec,
    row_groups: range,
    batch_rows: int,
    extra_columns: tuple[str, ...] = (),
) -> Iterator[pa.RecordBatch]:
    """Yields record batches of the spec's columns (plus `extra_columns` the file has).

    Raises:
        InputError: unreadable or corrupt data (naming the file), or a schema that no
            longer fits the spec.
    """
    with open_file(path) as parquet_file:
        schema = parquet_file.schema_arrow
        check_schema(schema, spec, path)
        columns = [name for name, _ in _roles(spec)]
        columns += [name for name in extra_columns if schema.names.count(name) == 1]
        if not len(row_groups):
            return
        try:
            yield from parquet_file.iter_batches(
                batch_size=batch_rows, row_groups=row_groups, columns=columns
            )
        except (OSError, ValueError, pa.ArrowException) as error:
            raise InputError(
                f"{path}: corrupt Parquet data in row groups {row_groups.start}.."
                f"{row_groups.stop - 1} ({error}); re-download or remove the file"
            ) from None


def _plain(column: pa.Array) -> pa.Array:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    return column


def _as_binary(column: pa.Array) -> pa.Array:
    """The raw text of each value as large_binary: strings as is, integers in decimal."""
    if _kind(column.type) in ("integer", "null"):
        column = pc.cast(column, pa.large_string())
    return pc.cast(column, pa.large_binary())


def _null_mask(column: pa.Array) -> np.ndarray:
    if column.null_count == 0:
        return np.zeros(len(column), bool)
    return column.is_null().to_numpy(zero_copy_only=False)


def _string_cells(column: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(byte buffer, starts [n, 1], lengths [n, 1]) of a string column; null = empty."""
    binary = _as_binary(column)
    n = len(binary)
    if n == 0:
        return np.zeros(0, np.uint8), np.zeros((0, 1), np.int64), np.zeros((0, 1), np.int64)
    offsets = np.frombuffer(binary.buffers()[1], np.int64)[binary.offset : binary.offset + n + 1]
    data = binary.buffers()[2]
    buffer = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
    if not len(buffer):
        buffer = np.zeros(1, np.uint8)  # the text parsers peek at the first byte of each cell
    lengths = np.where(_null_mask(binary), 0, np.diff(offsets))
    return buffer, offsets[:-1].reshape(-1, 1).copy(), lengths.reshape(-1, 1)


def _json_value(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    return value


class ParquetParser:
    """Parses record batches of one spec into output tables; build once per worker."""

    def __init__(self, spec: FeatureSpec):
        self.spec = spec
        self.schema = output_schema(spec)
        used = {name for name, _ in _roles(spec)}
        # Columns of the spec that no feature uses are read only for the hash split's row text.
        self.unused_columns = tuple(name for name in spec.columns if name not in used)

    def parse(self, batch: pa.RecordBatch, *, row_hashes: bool = False) -> ParsedBlock:
        """Parses one batch; `row_hashes` also hashes each valid row's text form.

        The row text is the spec's columns joined by its delimiter, each value written
        as text (integers in decimal, lists joined by the separator, null as empty), so
        a row of canonical text (Criteo: decimal integers) lands in the same hash split
        as its text-log line.
        """
        spec = self.spec
        n = batch.num_rows
        reasons = np.zeros(n, np.int8)
        details: dict[int, str] = {}

        def reject(rows: np.ndarray, reason: str, describe) -> None:
            for row in rows[reasons[rows] == 0]:
                reasons[row] = REASON_CODE[reason]
                details[int(row)] = describe(int(row))

        label_column = _plain(batch.column(spec.label))
        labels, label_text = self._labels(label_column, reject)
        values, missing, dense_text = self._dense(batch, reject)
        keep = reasons == 0

        columns = [pa.array(labels)]
        dense = transform_dense(values, missing, spec.dense_transform)
        columns += [pa.array(dense[:, j]) for j in range(dense.shape[1])]
        texts = {spec.label: label_text, **dense_text}
        for prefix, feature in enumerate(spec.categorical, 1):
            column = _plain(batch.column(feature.name))
            if feature.multi_valued:
                ids, text = self._multi_valued(column, feature.separator, prefix, row_hashes)
            else:
                text = _as_binary(column)
                hashes, lengths = hash_binary_array(text)
                ids = pa.array(hashing.feature_ids(hashes, lengths == 0, prefix, spec.prefix_bits))
            columns.append(ids)
            texts[feature.name] = text
        table = pa.Table.from_arrays(columns, schema=self.schema)
        rows = np.flatnonzero(keep)
        if not keep.all():
            table = table.filter(pa.array(keep))

        hashes = self._row_hashes(batch, texts, keep) if row_hashes else np.zeros(0, np.uint64)
        rejected = []
        if not keep.all():
            bad = np.flatnonzero(~keep)
            shown = batch.take(pa.array(bad)).to_pylist()
            for row, values_of_row in zip(bad, shown, strict=True):
                record = {name: _json_value(value) for name, value in values_of_row.items()}
                rejected.append((int(row), REASONS[reasons[row] - 1], details[int(row)], record))
        return ParsedBlock(table, rows, hashes, rejected, 0, n)

    def _labels(self, column: pa.Array, reject) -> tuple[np.ndarray, pa.Array]:
        kind = _kind(column.type)
        if kind == "string":
            negative, positive = (value.encode() for value in self.spec.label_values)
            text = pc.cast(column, pa.large_binary())
            ones = pc.equal(text, positive).fill_null(False).to_numpy(zero_copy_only=False)
            zeros = pc.equal(text, negative).fill_null(False).to_numpy(zero_copy_only=False)
            ok = ones | zeros
        else:
            numbers = pc.cast(column, pa.float64()).fill_null(math.nan)
            numbers = numbers.to_numpy(zero_copy_only=False)
            ones, ok = numbers == 1.0, (numbers == 0.0) | (numbers == 1.0)

        def describe(row: int) -> str:
            value = column[row].as_py()
            if value is None:
                return "label is missing (null)"
            if kind == "string":
                return f"label {_json_value(value)!r} is not {' or '.join(self.spec.label_values)}"
            return f"label {_json_value(value)!r} is not 0 or 1"

        reject(np.flatnonzero(~ok), "bad_label", describe)
        text = pc.if_else(pa.array(ones), pa.scalar(b"1", pa.large_binary()), b"0")
        return ones.astype(np.float32), text

    def _dense(self, batch: pa.RecordBatch, reject):
        """(values [n, d] int64 or float64, missing [n, d], {name: text for the row hash})."""
        spec = self.spec
        n = batch.num_rows
        integer = spec.dense_type == "int64"
        values = np.zeros((n, len(spec.dense)), np.int64 if integer else np.float64)
        missing = np.zeros((n, len(spec.dense)), bool)
        texts: dict[str, pa.Array] = {}
        for j, name in enumerate(spec.dense):
            column = _plain(batch.column(name))
            kind = _kind(column.type)

            def describe(row: int, name=name, column=column, note="") -> str:
                value = column[row].as_py()
                if isinstance(value, bytes):
                    value = value.decode("utf-8", "backslashreplace")
                return f"{name}={value!r}{note}"

            if kind == "string":
                parse = parse_ints if integer else parse_floats
                parsed, empty, non_numeric, overflow = parse(*_string_cells(column))
                values[:, j], missing[:, j] = parsed[:, 0], empty[:, 0]
                reject(np.flatnonzero(non_numeric[:, 0]), "non_numeric_dense", describe)
                reject(np.flatnonzero(overflow[:, 0]), "int64_overflow", describe)
                if not integer:
                    nonfinite = ~np.isfinite(values[:, j]) & ~missing[:, j]
                    reject(np.flatnonzero(nonfinite), "non_finite_dense", describe)
                texts[name] = pc.cast(column, pa.large_binary())
                continue
            missing[:, j] = _null_mask(column)
            if kind == "null":
                continue
            if kind == "integer" and integer:
                if pa.types.is_uint64(column.type):
                    raw = column.fill_null(0).to_numpy(zero_copy_only=False)
                    too_big = raw > np.uint64(2**63 - 1)
                    reject(np.flatnonzero(too_big), "int64_overflow", describe)
                    values[:, j] = np.where(too_big, 0, raw).astype(np.int64)
                else:
                    values[:, j] = pc.cast(column.fill_null(0), pa.int64()).to_numpy()
            elif kind == "integer":
                # rounds like the text parser does for integers beyond 2**53
                values[:, j] = pc.cast(column.fill_null(0), pa.float64(), safe=False).to_numpy()
            else:
                floats = pc.cast(column, pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False)
                finite = np.isfinite(floats)
                reject(np.flatnonzero(~finite), "non_finite_dense", describe)
                if integer:
                    whole = finite & (np.floor(floats) == floats)
                    inside = whole & (np.abs(floats) < _INT64_LIMIT)
                    note = " (not an integer; the spec's dense_type is int64)"
                    reject(
                        np.flatnonzero(finite & ~whole),
                        "non_numeric_dense",
                        lambda row, note=note, describe=describe: describe(row, note=note),
                    )
                    reject(np.flatnonzero(whole & ~inside), "int64_overflow", describe)
                    values[:, j] = np.where(inside, floats, 0.0).astype(np.int64)
                else:
                    values[:, j] = np.where(finite, floats, 0.0)
            if integer or kind == "integer":
                # the decimal text of the integer value, as in a text log
                number = pa.array(values[:, j], mask=missing[:, j])
                texts[name] = pc.cast(pc.cast(number, pa.large_string()), pa.large_binary())
            else:
                texts[name] = pc.cast(pc.cast(column, pa.large_string()), pa.large_binary())
        return values, missing, texts

    def _multi_valued(self, column: pa.Array, separator: str, prefix: int, with_text: bool):
        """(list<uint64> ids, text of each field joined by the separator or None) of one feature."""
        bits = self.spec.prefix_bits
        if not _kind(column.type).startswith("list"):
            text = _as_binary(column).fill_null(b"")
            return split_multi_valued_ids(text, separator, prefix, bits), text
        counts = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False)
        values = _as_binary(column.flatten())
        hashes, lengths = hash_binary_array(values)
        value_ids = hashing.feature_ids(hashes, lengths == 0, prefix, bits)
        counts = counts.astype(np.int64)
        out_counts = np.maximum(counts, 1)  # an empty or null list is one missing value
        out_offsets = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(out_counts, out=out_offsets[1:])
        in_offsets = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=in_offsets[1:])
        ids = np.full(out_offsets[-1], hashing.missing_id(prefix, bits), np.uint64)
        positions = np.repeat(out_offsets[:-1] - in_offsets[:-1], counts) + np.arange(len(values))
        ids[positions] = value_ids
        lists = pa.ListArray.from_arrays(pa.array(out_offsets.astype(np.int32)), pa.array(ids))
        if not with_text:
            return lists, None
        filled = values.fill_null(b"")
        joined = pa.ListArray.from_arrays(pa.array(in_offsets.astype(np.int32)), filled)
        text = pc.binary_join(joined, pa.scalar(separator.encode(), pa.large_binary()))
        return lists, text

    def _row_hashes(self, batch: pa.RecordBatch, texts: dict, keep: np.ndarray) -> np.ndarray:
        """Hashes of the valid rows' text: the spec's columns joined by its delimiter."""
        n = batch.num_rows
        names = batch.schema.names
        buffers, cell_starts, cell_lengths = [], [], []
        base = 0
        for name in self.spec.columns:
            text = texts.get(name)
            if text is None and name in names:
                try:
                    text = _as_binary(pc.cast(_plain(batch.column(name)), pa.large_string()))
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    text = None  # not representable as text: counts as empty
            if text is None:
                cell_starts.append(np.zeros(n, np.int64))
                cell_lengths.append(np.zeros(n, np.int64))
                continue
            buffer, starts, lengths = _string_cells(text)
            buffers.append(buffer)
            cell_starts.append(starts[:, 0] + base)
            cell_lengths.append(lengths[:, 0])
            base += len(buffer)
        buffers.append(np.frombuffer(self.spec.delimiter.encode(), np.uint8))
        buffer = np.concatenate(buffers)
        # cells in row-major order with a delimiter cell between columns: their bytes,
        # concatenated, are the rows' text one after the other
        width = 2 * len(self.spec.columns) - 1
        starts = np.full((n, width), base, np.int64)
        lengths = np.ones((n, width), np.int64)
        starts[:, 0::2] = np.stack(cell_starts, axis=1)
        lengths[:, 0::2] = np.stack(cell_lengths, axis=1)
        starts, lengths = starts[keep].ravel(), lengths[keep].ravel()
        cell_offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=cell_offsets[1:])
        index = np.repeat(starts - cell_offsets[:-1], lengths) + np.arange(cell_offsets[-1])
        row_offsets = cell_offsets[::width]
        return hashing.hash_fields(
            hashing.padded_words(buffer[index]), row_offsets[:-1], np.diff(row_offsets)
        )
