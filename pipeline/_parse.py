"""Vectorized parsing of delimited text blocks into output tables.

A block is a bytes object holding complete lines (each ends with a newline).
Everything is done on whole blocks with numpy: find separators, check field
counts, validate labels and dense numbers, hash categoricals. Only cells that
need an exact check (non-ASCII lines, integers with 19+ digits, floats that
Arrow refuses) go through a per-value Python path, and only for those cells.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from hybridrec.pipeline import hashing
from hybridrec.pipeline.spec import FeatureSpec

REASONS = (
    "wrong_field_count",
    "invalid_utf8",
    "bad_label",
    "non_numeric_dense",
    "int64_overflow",
    "non_finite_dense",
)
REASON_CODE = {reason: code for code, reason in enumerate(REASONS, start=1)}
_MAX_REJECTED_TEXT = 4096
_INT_PATTERN = re.compile(rb"[+-]?[0-9]+")
_INT64_MAX = 2**63 - 1


def output_schema(spec: FeatureSpec) -> pa.Schema:
    """Contract 1 columns: label f32, dense f32, categorical uint64 or list<uint64>."""
    fields = [pa.field(spec.label, pa.float32(), nullable=False)]
    fields += [pa.field(name, pa.float32(), nullable=False) for name in spec.dense]
    for feature in spec.categorical:
        kind = pa.list_(pa.uint64()) if feature.multi_valued else pa.uint64()
        fields.append(pa.field(feature.name, kind, nullable=False))
    return pa.schema(fields)


@dataclasses.dataclass
class ParsedBlock:
    """The result of parsing one block.

    Attributes:
        table: the valid rows, in input order, with `output_schema` columns.
        line_offsets: int64 [rows] 0-based line index of each valid row in the block.
        row_hashes: uint64 [rows] hash of each valid row's bytes (hash split only, else empty).
        rejected: (line index in block, reason, detail, raw text) per rejected line.
        crlf_lines: lines that ended in CRLF (accepted; the CR is dropped).
        lines: all lines of the block, valid or not.
    """

    table: pa.Table
    line_offsets: np.ndarray
    row_hashes: np.ndarray
    rejected: list[tuple[int, str, str, str]]
    crlf_lines: int
    lines: int


def line_text(buffer: np.ndarray, start: int, end: int) -> str:
    raw = buffer[start : min(end, start + _MAX_REJECTED_TEXT)].tobytes()
    text = raw.decode("utf-8", errors="backslashreplace")
    return text + ("..." if end - start > _MAX_REJECTED_TEXT else "")


def gather_strings(buffer: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """Copies (start, length) slices of `buffer` into one Arrow large_binary array."""
    lengths = lengths.astype(np.int64)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    index = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
    data = buffer[index] if len(index) else np.zeros(0, np.uint8)
    return pa.Array.from_buffers(
        pa.large_binary(), len(lengths), [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


def parse_ints(buffer, starts, lengths):
    """Parses integer cells. Returns (values int64, missing, non_numeric, overflow), all [n, d]."""
    # Column selections can be Fortran-ordered; the flat views below must alias the arrays.
    starts, lengths = np.ascontiguousarray(starts), np.ascontiguousarray(lengths)
    missing = lengths == 0
    first = buffer[np.minimum(starts, len(buffer) - 1)]
    signed = ~missing & ((first == ord("-")) | (first == ord("+")))
    negative = signed & (first == ord("-"))
    digit_starts = starts + signed
    digits = lengths - signed
    non_numeric = ~missing & (digits <= 0)
    long_cells = digits >= 19
    values = np.zeros(starts.shape, np.int64)
    flat_values, flat_bad = values.reshape(-1), non_numeric.reshape(-1)
    flat_starts, flat_digits = digit_starts.reshape(-1), digits.reshape(-1)
    # Work only on the cells that still have a k-th digit: cost ~ total digits, not cells * 18.
    active = np.flatnonzero((flat_digits > 0) & ~long_cells.reshape(-1))
    for k in range(18):
        if k:
            active = active[flat_digits[active] > k]
        if not len(active):
            break
        digit = buffer[flat_starts[active] + k].astype(np.int64) - ord("0")
        flat_bad[active[(digit < 0) | (digit > 9)]] = True
        flat_values[active] = flat_values[active] * 10 + digit
    values = np.where(negative, -values, values)
    overflow = np.zeros(starts.shape, bool)
    for index in zip(*np.nonzero(long_cells & ~non_numeric), strict=True):
        raw = buffer[starts[index] : starts[index] + lengths[index]].tobytes()
        if not _INT_PATTERN.fullmatch(raw):
            non_numeric[index] = True
        elif abs(int(raw)) > _INT64_MAX and int(raw) != -(2**63):
            overflow[index] = True
        else:
            values[index] = int(raw)
    return values, missing, non_numeric, overflow


def parse_floats(buffer, starts, lengths):
    """Parses float cells through Arrow; exact per-cell check only if Arrow refuses the batch."""
    missing = lengths == 0
    flat = gather_strings(buffer, starts.ravel(), lengths.ravel())
    non_numeric = np.zeros(starts.shape, bool)
    try:
        text = flat.cast(pa.large_string())
        values = pc.cast(pc.if_else(pc.equal(pc.binary_length(text), 0), None, text), pa.float64())
        values = values.fill_null(0.0).to_numpy(zero_copy_only=False).reshape(starts.shape)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        values = np.zeros(starts.ravel().shape, np.float64)
        for i, raw in enumerate(flat.to_pylist()):
            if raw:
                try:
                    values[i] = float(raw)
                except ValueError:
                    non_numeric.ravel()[i] = True
        values = values.reshape(starts.shape)
    return values, missing, non_numeric, np.zeros(starts.shape, bool)


def transform_dense(values: np.ndarray, missing: np.ndarray, transform: str) -> np.ndarray:
    values = values.astype(np.float64)
    values[missing] = 0.0
    if transform == "log1p":
        values = np.log1p(np.maximum(values, 0.0))
    return values.astype(np.float32)


def _field_equals(
    buffer: np.ndarray, starts: np.ndarray, lengths: np.ndarray, value: bytes
) -> np.ndarray:
    """Which fields equal `value`.

    Args:
        buffer: the block's bytes, uint8 [N].
        starts, lengths: each row's field start offset and length, int64 [R].
        value: the bytes to compare with.

    Returns:
        bool [R].
    """
    equal = lengths == len(value)
    last = max(len(buffer) - 1, 0)
    for offset, byte in enumerate(value):
        equal &= buffer[np.minimum(starts + offset, last)] == byte
    return equal


class BlockParser:
    """Parses blocks of one spec; build once per worker (DoFn.setup) and reuse."""

    def __init__(self, spec: FeatureSpec):
        self.spec = spec
        self.schema = output_schema(spec)
        self.num_columns = len(spec.columns)
        self.delimiter = spec.delimiter.encode()[0]
        self.label_column = spec.column_index(spec.label)
        self.label_values = tuple(value.encode() for value in spec.label_values)
        self.dense_columns = np.array([spec.column_index(n) for n in spec.dense], np.int64)
        self.single = [
            (prefix, f) for prefix, f in enumerate(spec.categorical, 1) if not f.multi_valued
        ]
        self.multi = [(prefix, f) for prefix, f in enumerate(spec.categorical, 1) if f.multi_valued]
        self.single_columns = np.array(
            [spec.column_index(f.name) for _, f in self.single], np.int64
        )
        self.single_prefixes = np.array([p for p, _ in self.single], np.uint64)

    def parse(self, block: bytes, *, row_hashes: bool = False) -> ParsedBlock:
        """Parses `block` (complete lines); `row_hashes` also hashes each valid line."""
        if block and not block.endswith(b"\n"):
            block += b"\n"  # the last line of a file may lack its newline
        crlf_lines = block.count(b"\r\n") if b"\r" in block else 0  # memchr first: fast
        if crlf_lines:
            block = block.replace(b"\r\n", b"\n")
        buffer = np.frombuffer(block, np.uint8)
        separators = np.flatnonzero((buffer == self.delimiter) | (buffer == ord("\n")))
        is_newline = buffer[separators] == ord("\n")
        newlines = separators[is_newline]
        num_lines = len(newlines)
        line_starts = np.zeros(num_lines, np.int64)
        line_starts[1:] = newlines[:-1] + 1
        separator_line = np.cumsum(is_newline) - is_newline
        fields_per_line = np.bincount(separator_line, minlength=num_lines)

        reasons = np.zeros(num_lines, np.int8)
        details: dict[int, str] = {}
        for line in np.flatnonzero(fields_per_line != self.num_columns):
            reasons[line] = REASON_CODE["wrong_field_count"]
            details[line] = f"{fields_per_line[line]} fields, expected {self.num_columns}"
        if num_lines and buffer.max() >= 0x80:
            for line in np.unique(np.searchsorted(newlines, np.flatnonzero(buffer >= 0x80))):
                try:
                    buffer[line_starts[line] : newlines[line]].tobytes().decode("utf-8")
                except UnicodeDecodeError as error:
                    if not reasons[line]:
                        reasons[line] = REASON_CODE["invalid_utf8"]
                        details[line] = f"byte {error.start + 1} of the line"

        good = np.flatnonzero(reasons == 0)
        ends = separators[(reasons == 0)[separator_line]].reshape(-1, self.num_columns)
        starts = np.empty_like(ends)
        starts[:, 0] = line_starts[good]
        starts[:, 1:] = ends[:, :-1] + 1
        lengths = ends - starts

        row_bad = np.zeros(len(good), np.int8)
        label_start = starts[:, self.label_column]
        label_char = buffer[np.minimum(label_start, max(len(buffer) - 1, 0))] if len(good) else None
        if len(good) and self.label_values == (b"0", b"1"):
            label_ok = (lengths[:, self.label_column] == 1) & (
                (label_char == ord("0")) | (label_char == ord("1"))
            )
            labels = (label_char == ord("1")).astype(np.float32)
        elif len(good):
            negative, positive = (
                _field_equals(buffer, label_start, lengths[:, self.label_column], value)
                for value in self.label_values
            )
            label_ok = negative | positive
            labels = positive.astype(np.float32)
        if len(good):
            expected = " or ".join(v.decode() for v in self.label_values)
            for row in np.flatnonzero(~label_ok):
                row_bad[row] = REASON_CODE["bad_label"]
                raw = buffer[label_start[row] : ends[row, self.label_column]].tobytes()
                details[good[row]] = (
                    f"label {raw.decode('utf-8', 'backslashreplace')!r} is not {expected}"
                )
        else:
            labels = np.zeros(0, np.float32)

        dense_starts = starts[:, self.dense_columns]
        dense_lengths = lengths[:, self.dense_columns]
        parse_dense = parse_ints if self.spec.dense_type == "int64" else parse_floats
        values, missing, non_numeric, overflow = parse_dense(buffer, dense_starts, dense_lengths)
        # "nan" and "inf" parse as floats; they are rejected like any non-finite value
        non_finite = ~np.isfinite(values) & ~missing & ~non_numeric
        for reason, cells in (
            ("non_numeric_dense", non_numeric),
            ("int64_overflow", overflow),
            ("non_finite_dense", non_finite),
        ):
            for row, column in zip(*np.nonzero(cells), strict=True):
                if row_bad[row]:
                    continue
                row_bad[row] = REASON_CODE[reason]
                raw = buffer[
                    dense_starts[row, column] : dense_starts[row, column]
                    + dense_lengths[row, column]
                ]
                name = self.spec.dense[column]
                details[good[row]] = f"{name}={raw.tobytes().decode('utf-8', 'backslashreplace')!r}"
        reasons[good] = row_bad

        keep = row_bad == 0
        rows = good[keep]
        words = hashing.padded_words(buffer)
        columns = [pa.array(labels[keep])]
        dense = transform_dense(values[keep], missing[keep], self.spec.dense_transform)
        columns += [pa.array(dense[:, j]) for j in range(dense.shape[1])]
        categorical = self._single_valued_ids(words, starts[keep], lengths[keep])
        categorical.update(self._multi_valued_ids(buffer, starts[keep], lengths[keep]))
        columns += [categorical[f.name] for f in self.spec.categorical]
        table = pa.Table.from_arrays(columns, schema=self.schema)

        if row_hashes:
            line_lengths = newlines[rows] - line_starts[rows]
            hashes = hashing.hash_fields(words, line_starts[rows], line_lengths)
        else:
            hashes = np.zeros(0, np.uint64)
        rejected = [
            (
                int(line),
                REASONS[reasons[line] - 1],
                details.get(int(line), ""),
                line_text(buffer, line_starts[line], newlines[line]),
            )
            for line in np.flatnonzero(reasons)
        ]
        return ParsedBlock(table, rows, hashes, rejected, crlf_lines, num_lines)

    def _single_valued_ids(self, words, starts, lengths) -> dict[str, pa.Array]:
        if not self.single:
            return {}
        cell_starts = starts[:, self.single_columns]
        cell_lengths = lengths[:, self.single_columns]
        raw = hashing.hash_fields(words, cell_starts, cell_lengths)
        bits = np.uint64(self.spec.prefix_bits)
        low = raw >> bits
        low[low == 0] = 1
        low[cell_lengths == 0] = 0
        ids = low | (self.single_prefixes[None, :] << (np.uint64(64) - bits))
        return {f.name: pa.array(ids[:, j]) for j, (_, f) in enumerate(self.single)}

    def _multi_valued_ids(self, buffer, starts, lengths) -> dict[str, pa.Array]:
        result = {}
        for prefix, feature in self.multi:
            column = self.spec.column_index(feature.name)
            fields = gather_strings(buffer, starts[:, column], lengths[:, column])
            result[feature.name] = split_multi_valued_ids(
                fields, feature.separator, prefix, self.spec.prefix_bits
            )
        return result


def binary_cells(array: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(buffer uint8, starts, lengths) of the values of a large_binary array (null: 0 long)."""
    n = len(array)
    offsets = np.frombuffer(array.buffers()[1], np.int64)[array.offset : array.offset + n + 1]
    data = array.buffers()[2]
    buffer = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    if array.null_count:
        lengths = np.where(array.is_null().to_numpy(zero_copy_only=False), 0, lengths)
    return buffer, offsets[:-1], lengths


def hash_binary_array(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Raw hashes and byte lengths of the values of a large_binary array (null: length 0)."""
    if len(array) == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    buffer, starts, lengths = binary_cells(array)
    return hashing.hash_fields(hashing.padded_words(buffer), starts, lengths), lengths


def split_multi_valued_ids(
    fields: pa.Array, separator: str, prefix: int, prefix_bits: int
) -> pa.ListArray:
    """list<uint64> ids of separator-joined fields (large_binary, no nulls); "" is missing."""
    lists = pc.split_pattern(fields, separator)
    hashes, value_lengths = hash_binary_array(lists.flatten())
    ids = hashing.feature_ids(hashes, value_lengths == 0, prefix, prefix_bits)
    list_offsets = lists.offsets.to_numpy().astype(np.int32)
    list_offsets = list_offsets - list_offsets[0]
    return pa.ListArray.from_arrays(pa.array(list_offsets), pa.array(ids))
