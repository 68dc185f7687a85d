"""Single raw rows -> model inputs, exactly as the Beam job turns a log into Parquet.

What a served model receives is a row of the dataset's own layout, often without
its label (nobody knows it yet). `RowEncoder` runs the job's own parser on such
rows (`pipeline._parse.BlockParser`: the same field checks, the same dense
transform, the same id hashing), so a row scored online gets the ids and dense
values it would have had in the training data.

Example:
    encoder = RowEncoder(load_spec("criteo"))
    rows = encoder.encode([b"\\t".join(fields) for fields in ...])
    rows.dense            # [n, 13] float32, log1p-transformed
    rows.ids["C1"]        # [n] uint64
    # a multi-valued feature: (values [nnz] uint64, offsets [n + 1] int64), row r's bag
    # is values[offsets[r]:offsets[r + 1]] (an empty field: a bag of its missing id)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from hybridrec.common import config
from hybridrec.common.errors import UserError
from hybridrec.pipeline._parse import BlockParser
from hybridrec.pipeline.spec import FeatureSpec


class RowError(UserError):
    """A raw row the Beam job would reject; `row` is its 0-based index in the request."""

    def __init__(self, row: int, reason: str, detail: str):
        self.row, self.reason, self.detail = row, reason, detail
        super().__init__(f"row {row}: {reason}" + (f" ({detail})" if detail else ""))


@dataclasses.dataclass
class EncodedRows:
    """Model inputs of n rows.

    Attributes:
        dense: [n, num_dense] float32 transformed dense values.
        ids: feature -> [n] uint64 ids (single-valued) or (values [nnz] uint64,
            offsets [n + 1] int64) for a multi-valued feature; features in spec order.
    """

    dense: np.ndarray
    ids: dict[str, Any]


def spec_from_json(data: Mapping[str, Any]) -> FeatureSpec:
    """The FeatureSpec recorded in metadata.json (`FeatureSpec.to_json`)."""
    return config.from_dict(FeatureSpec, dict(data))


class RowEncoder:
    """Encodes raw text rows of one spec; build once, reuse (thread-safe: no mutable state).

    A row may carry every column of the spec (its label field is ignored) or every
    column but the label.
    """

    def __init__(self, spec: FeatureSpec):
        self.spec = spec
        self._parser = BlockParser(spec)
        self._delimiter = spec.delimiter.encode()
        self._label_index = spec.column_index(spec.label)
        self._placeholder_label = spec.label_values[0].encode()
        self._width = len(spec.columns)

    def _with_label(self, index: int, line: bytes) -> bytes:
        if line.endswith(b"\r"):
            line = line[:-1]
        if b"\n" in line or b"\r" in line:
            raise RowError(index, "newline_in_row", "one row per element")
        fields = line.split(self._delimiter)
        if len(fields) == self._width:
            fields[self._label_index] = self._placeholder_label
        elif len(fields) == self._width - 1:
            fields.insert(self._label_index, self._placeholder_label)
        else:
            raise RowError(
                index,
                "wrong_field_count",
                f"{len(fields)} fields, expected {self._width} (or {self._width - 1} "
                f"without the {self.spec.label!r} column)",
            )
        return self._delimiter.join(fields)

    def encode(self, lines: Sequence[bytes | str]) -> EncodedRows:
        """Parses, validates, transforms and hashes `lines` (one row each, no newline).

        Raises:
            RowError: the first row the Beam job would reject, with its reason.
        """
        block = b"\n".join(
            self._with_label(index, line.encode() if isinstance(line, str) else bytes(line))
            for index, line in enumerate(lines)
        )
        parsed = self._parser.parse(block + b"\n" if lines else b"")
        if parsed.rejected:
            row, reason, detail, _ = parsed.rejected[0]
            raise RowError(row, reason, detail)
        table = parsed.table
        dense = np.empty((table.num_rows, len(self.spec.dense)), np.float32)
        for column, name in enumerate(self.spec.dense):
            dense[:, column] = table.column(name).to_numpy()
        ids: dict[str, Any] = {}
        for feature in self.spec.categorical:
            column = table.column(feature.name).combine_chunks()
            if feature.multi_valued:
                offsets = column.offsets.to_numpy().astype(np.int64)
                values = column.values.to_numpy().astype(np.uint64, copy=False)
                ids[feature.name] = (values[offsets[0] : offsets[-1]], offsets - offsets[0])
            else:
                ids[feature.name] = column.to_numpy().astype(np.uint64, copy=False)
        return EncodedRows(dense=dense, ids=ids)
