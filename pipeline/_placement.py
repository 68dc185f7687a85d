"""Placing parsed chunks: final line numbers and the position split, after parsing.

The parse step writes each chunk with chunk-local line numbers and, under a position
split, every row to train; once every chunk's line count is known, the one chunk that
holds the eval boundary is split here.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems
from hybridrec.pipeline._chunks import ROW_GROUP_ROWS, SplitWriter
from hybridrec.pipeline.spec import FeatureSpec
from hybridrec.pipeline.stats import PartialStats


def kept_lines(lines: int, rejected_lines: np.ndarray, header: bool) -> np.ndarray:
    """Chunk-local line indices of the rows a chunk wrote, in order: [rows] int64.

    Args:
        lines: lines of the chunk (header included).
        rejected_lines: [rejected] int64, chunk-local indices of its rejected lines.
        header: line 0 is a header (the first chunk of a text file with a header).
    """
    dropped = np.concatenate([rejected_lines.astype(np.int64), [0] if header else []])
    return np.setdiff1d(np.arange(lines, dtype=np.int64), dropped)


def split_written_chunk(
    temp_dir: str,
    key: str,
    row_lines: np.ndarray,
    first_lines: dict[str, int],
    *,
    spec: FeatureSpec,
    schema: pa.Schema,
    compression: str,
) -> PartialStats:
    """Moves the rows of `train/chunk-KEY.parquet` from `first_lines["valid"]` on to valid
    and from `first_lines["eval"]` on to eval.

    Used for a chunk a position split's boundary falls inside: the parse step wrote all its
    rows to train before the input's total line count was known.

    Args:
        row_lines: [rows] int64, chunk-local line index of each row of the file.
        first_lines: chunk-local line index where each later split begins, in line
            order ("valid" with a valid split, then "eval"; a line past the chunk: none
            of it).

    Returns:
        Statistics of the rows that stay in train (rows_by_split and files of every split).
    """
    source = FileSystems.join(temp_dir, "train", f"chunk-{key}.parquet")
    staged = FileSystems.join(temp_dir, "train", f"chunk-{key}.parquet.split")
    names = ("train", *first_lines)
    writers = {
        name: SplitWriter(
            staged if name == "train" else FileSystems.join(temp_dir, name, f"chunk-{key}.parquet"),
            schema,
            compression,
        )
        for name in names
    }
    starts = np.array([first_lines[name] for name in names[1:]], np.int64)
    if np.any(np.diff(starts) < 0):
        raise ValueError(f"split starts out of line order: {first_lines}")
    stats = PartialStats(source=key)
    row = 0
    with FileSystems.open(source) as handle:
        for batch in pq.ParquetFile(handle).iter_batches(batch_size=ROW_GROUP_ROWS):
            table = pa.Table.from_batches([batch], schema)
            # each row's split: how many of the later splits' starts its line is at or past
            assigned = np.searchsorted(starts, row_lines[row : row + table.num_rows], "right")
            row += table.num_rows
            for index, name in enumerate(names):
                part = table.filter(pa.array(assigned == index))
                writers[name].write(part)
                if name == "train":
                    stats.add_table(part, spec)
    if row != len(row_lines):
        raise RuntimeError(f"{source}: {row} rows, expected {len(row_lines)}")
    for name, writer in writers.items():
        rows = writer.close()
        stats.rows_by_split[name] = rows
        if rows:
            stats.files.append((name, key, rows))
    FileSystems.delete([source])
    if stats.rows_by_split["train"]:
        FileSystems.rename([staged], [source])
    return stats
