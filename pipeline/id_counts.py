"""How often each id of each categorical feature occurs in a split: a Beam job.

The access frequencies a learned id -> bucket mapping starts from (training.learned_hash).
Each file is counted where it is read (`np.unique` per feature), and the partial counts
of one feature merge in a combiner, so the pipeline moves one (ids, counts) pair per file
and feature rather than one element per id.

    counts = count_ids(read_metadata("runs/data"), split="train")
    counts["C1"]  # (ids [n] uint64 by descending count, counts [n] int64)
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from hybridrec.common.errors import UserError
from hybridrec.pipeline.metadata import DatasetMetadata

Counts = tuple[np.ndarray, np.ndarray]  # (ids [n] uint64, counts [n] int64)


def _merge(parts: Sequence[Counts]) -> Counts:
    """The counts of several parts added up per id (ids ascending)."""
    parts = [part for part in parts if len(part[0])]
    if not parts:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    ids = np.concatenate([part[0] for part in parts])
    counts = np.concatenate([part[1] for part in parts])
    unique, inverse = np.unique(ids, return_inverse=True)
    return unique, np.bincount(inverse, weights=counts, minlength=len(unique)).astype(np.int64)


def _count_file(path: str, features: Sequence[str]) -> Iterator[tuple[str, Counts]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=list(features))
    except (OSError, pa.ArrowInvalid, KeyError) as error:
        raise UserError(f"{path}: cannot read the categorical columns: {error}") from None
    for feature in features:
        column = table.column(feature)
        if pa.types.is_list(column.type):
            column = column.combine_chunks().flatten()
        ids = column.to_numpy().astype(np.uint64, copy=False)
        unique, counts = np.unique(ids, return_counts=True)
        yield feature, (unique, counts.astype(np.int64))


def _write_counts(item: tuple[str, Counts], directory: str, features: Sequence[str]) -> None:
    feature, (ids, counts) = item
    with open(Path(directory) / f"{features.index(feature)}.npz", "wb") as handle:
        np.savez(handle, ids=ids, counts=counts)


def count_ids(metadata: DatasetMetadata, split: str = "train") -> dict[str, Counts]:
    """Per categorical feature of `metadata`'s dataset: its ids in `split` and their counts,
    most frequent first (ties by id), counted by a Beam pipeline on the DirectRunner.

    Raises:
        UserError: the split has no files, or a file lacks a categorical column.
    """
    from apache_beam.options.pipeline_options import PipelineOptions
    from hybridrec.pipeline.click_job import (
        beam,  # Beam, imported with its import-time noise filtered
    )
    from hybridrec.pipeline.runners import make_pipeline

    files = [str(path) for path in metadata.split_files(split)]
    if not files:
        raise UserError(f"{metadata.root}: split {split!r} has no files to count ids in")
    features = [feature.name for feature in metadata.categorical]

    class MergeCounts(beam.CombineFn):
        def create_accumulator(self):
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)

        def add_input(self, accumulator, part):
            return _merge([accumulator, part])

        def merge_accumulators(self, accumulators):
            return _merge(list(accumulators))

        def extract_output(self, accumulator):
            return accumulator

    options = PipelineOptions(
        ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]
    )
    with tempfile.TemporaryDirectory(prefix="id-counts-") as directory:
        with make_pipeline(options) as pipeline:
            _ = (
                pipeline
                | "Files" >> beam.Create(files)
                | "CountPerFile" >> beam.FlatMap(_count_file, features)
                | "MergePerFeature" >> beam.CombinePerKey(MergeCounts())
                | "Write" >> beam.Map(_write_counts, directory, features)
            )
        collected = {}
        for index, feature in enumerate(features):
            path = Path(directory) / f"{index}.npz"
            if path.exists():
                with np.load(path) as arrays:
                    collected[feature] = (arrays["ids"], arrays["counts"])
    out = {}
    for feature in features:
        ids, counts = collected.get(feature, (np.zeros(0, np.uint64), np.zeros(0, np.int64)))
        order = np.lexsort((ids, -counts))  # descending count, then ascending id
        out[feature] = (ids[order], counts[order])
    return out
