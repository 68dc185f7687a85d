"""Dataset statistics: mergeable partial summaries and the Beam CombineFn over them.

Each processed input chunk produces one `PartialStats` (computed with numpy on
whole blocks); `DatasetStatsFn` merges them in any order, so the result is the
same on every runner and for any number of workers.

Categorical frequency information uses *distinct sampling*: an id is kept when
the lowest `level` bits of splitmix64(id) are zero, with exact counts; when more
than `SAMPLE_CAPACITY` ids are kept the level rises and half of them are
dropped. `kept ids * 2**level` estimates the distinct count, and the counts of
kept ids estimate how many ids occur at least k times (what an admission
threshold needs). Features with few ids stay exact (level 0).
"""

from __future__ import annotations

import dataclasses

import apache_beam as beam
import numpy as np
import pyarrow as pa
from hybridrec.pipeline import hashing

SAMPLE_CAPACITY = 16_384
COUNT_THRESHOLDS = (1, 2, 5, 10, 100, 1000)


@dataclasses.dataclass
class IdSample:
    level: int
    ids: np.ndarray  # uint64, sorted unique
    counts: np.ndarray  # int64

    @staticmethod
    def of(ids: np.ndarray, level: int = 0) -> IdSample:
        """Counts `ids` (already filtered to `level`)."""
        unique, counts = np.unique(ids, return_counts=True)
        return IdSample(level, unique, counts.astype(np.int64))._shrink()

    def _shrink(self) -> IdSample:
        sample = self
        while len(sample.ids) > SAMPLE_CAPACITY:
            sample = sample._filter(sample.level + 1)
        return sample

    def _filter(self, level: int) -> IdSample:
        if level == self.level:
            return self
        mask = hashing.splitmix64(self.ids) & np.uint64((1 << level) - 1) == 0
        return IdSample(level, self.ids[mask], self.counts[mask])

    def merge(self, other: IdSample) -> IdSample:
        level = max(self.level, other.level)
        a, b = self._filter(level), other._filter(level)
        ids = np.concatenate([a.ids, b.ids])
        unique, inverse = np.unique(ids, return_inverse=True)
        counts = np.bincount(inverse, weights=np.concatenate([a.counts, b.counts]))
        return IdSample(level, unique, counts.astype(np.int64))._shrink()

    def summary(self, rows: int) -> dict:
        scale = 2**self.level
        result = {
            "distinct_estimate": int(len(self.ids) * scale),
            "exact": self.level == 0,
            "sample_level": self.level,
            "ids_with_count_at_least": {
                str(k): int((self.counts >= k).sum() * scale) for k in COUNT_THRESHOLDS
            },
        }
        if self.level == 0 and len(self.ids):
            top = np.argsort(-self.counts, kind="stable")[:10]
            result["top_ids"] = [[int(self.ids[i]), int(self.counts[i])] for i in top]
        return result


SPLITS = ("train", "valid", "eval")  # a click-log dataset's splits (valid: on request)


@dataclasses.dataclass
class PartialStats:
    """Counts and statistics of part of the input; merge with `merge`."""

    rows_read: int = 0
    lines: int = 0  # input lines (Parquet: rows) read, a header line included
    rows_by_split: dict = dataclasses.field(default_factory=lambda: {"train": 0, "eval": 0})
    rejected_by_reason: dict = dataclasses.field(default_factory=dict)
    crlf_lines: int = 0
    empty_files: list = dataclasses.field(default_factory=list)
    files: list = dataclasses.field(default_factory=list)  # (split, temp file name, rows)
    label_sum: float = 0.0
    dense_count: int = 0
    dense_mean: np.ndarray | None = None
    dense_m2: np.ndarray | None = None
    dense_min: np.ndarray | None = None
    dense_max: np.ndarray | None = None
    categorical_missing: dict = dataclasses.field(default_factory=dict)
    id_samples: dict = dataclasses.field(default_factory=dict)
    source: str = ""  # the chunk these statistics are of (its key); "" once merged
    # Dense moments of merged chunks, (source, count, mean, m2, min, max) each, folded in
    # source order at the end: float merging is not associative, and runners combine in
    # different orders, so this keeps the statistics identical on every runner.
    dense_parts: list = dataclasses.field(default_factory=list)

    def counts_only(self) -> PartialStats:
        """These counts without the train-split statistics (for input that went to valid or
        eval)."""
        return PartialStats(
            rows_read=self.rows_read,
            lines=self.lines,
            rows_by_split=dict(self.rows_by_split),
            rejected_by_reason=dict(self.rejected_by_reason),
            crlf_lines=self.crlf_lines,
            empty_files=list(self.empty_files),
            files=list(self.files),
            source=self.source,
        )

    def with_train_stats_of(self, train: PartialStats) -> PartialStats:
        """These counts, with the rows_by_split, files and train statistics of `train`."""
        result = dataclasses.replace(
            train,
            rows_read=self.rows_read,
            lines=self.lines,
            rejected_by_reason=dict(self.rejected_by_reason),
            crlf_lines=self.crlf_lines,
            empty_files=list(self.empty_files),
        )
        result.files = [f for f in self.files if f[0] not in SPLITS] + train.files
        return result

    def add_table(self, table: pa.Table, spec) -> None:
        """Adds the statistics of output rows `table` (the train split)."""
        n = table.num_rows
        if n == 0:
            return
        self.label_sum += float(np.sum(table.column(spec.label).to_numpy()))
        if spec.dense:
            dense = np.stack(
                [table.column(name).to_numpy().astype(np.float64) for name in spec.dense], axis=1
            )
            other = PartialStats(
                dense_count=n,
                dense_mean=dense.mean(axis=0),
                dense_m2=((dense - dense.mean(axis=0)) ** 2).sum(axis=0),
                dense_min=dense.min(axis=0),
                dense_max=dense.max(axis=0),
            )
            self._merge_dense(other)
        for prefix, feature in enumerate(spec.categorical, 1):
            column = table.column(feature.name).combine_chunks()
            ids = (column.flatten() if feature.multi_valued else column).to_numpy()
            missing_id = np.uint64(hashing.missing_id(prefix, spec.prefix_bits))
            self.categorical_missing[feature.name] = self.categorical_missing.get(
                feature.name, 0
            ) + int(np.count_nonzero(ids == missing_id))
            current = self.id_samples.get(feature.name)
            level = current.level if current is not None else 0
            if level:
                ids = ids[hashing.splitmix64(ids) & np.uint64((1 << level) - 1) == 0]
            sample = IdSample.of(ids, level)
            self.id_samples[feature.name] = sample if current is None else current.merge(sample)

    def _merge_dense(self, other: PartialStats) -> None:
        if other.dense_count == 0:
            return
        if self.dense_count == 0:
            self.dense_count, self.dense_mean, self.dense_m2 = (
                other.dense_count,
                other.dense_mean,
                other.dense_m2,
            )
            self.dense_min, self.dense_max = other.dense_min, other.dense_max
            return
        total = self.dense_count + other.dense_count
        delta = other.dense_mean - self.dense_mean
        self.dense_mean = self.dense_mean + delta * other.dense_count / total
        self.dense_m2 = (
            self.dense_m2 + other.dense_m2 + delta**2 * self.dense_count * other.dense_count / total
        )
        self.dense_min = np.minimum(self.dense_min, other.dense_min)
        self.dense_max = np.maximum(self.dense_max, other.dense_max)
        self.dense_count = total

    def _own_dense_parts(self) -> list:
        if not self.dense_count:
            return list(self.dense_parts)
        own = (self.source, self.dense_count, self.dense_mean, self.dense_m2)
        return [(*own, self.dense_min, self.dense_max), *self.dense_parts]

    def dense_moments(self) -> PartialStats:
        """The dense moments of everything merged, folded in chunk order."""
        folded = PartialStats()
        for _, count, mean, m2, low, high in sorted(self._own_dense_parts(), key=lambda p: p[0]):
            folded._merge_dense(PartialStats(dense_count=count, dense_mean=mean, dense_m2=m2,
                                             dense_min=low, dense_max=high))  # fmt: skip
        return folded

    def merge(self, other: PartialStats) -> PartialStats:
        parts = self._own_dense_parts() + other._own_dense_parts()
        self.dense_count, self.dense_mean, self.dense_m2 = 0, None, None
        self.dense_min, self.dense_max = None, None
        self.dense_parts, self.source = parts, ""
        self.rows_read += other.rows_read
        self.lines += other.lines
        for split, rows in other.rows_by_split.items():
            self.rows_by_split[split] = self.rows_by_split.get(split, 0) + rows
        for reason, count in other.rejected_by_reason.items():
            self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + count
        self.crlf_lines += other.crlf_lines
        self.empty_files += other.empty_files
        self.files += other.files
        self.label_sum += other.label_sum
        for name, missing in other.categorical_missing.items():
            self.categorical_missing[name] = self.categorical_missing.get(name, 0) + missing
        for name, sample in other.id_samples.items():
            current = self.id_samples.get(name)
            self.id_samples[name] = sample if current is None else current.merge(sample)
        return self

    def to_json(self, spec) -> dict:
        """Counts and statistics in metadata.json form (statistics are of the train split)."""
        train_rows = self.rows_by_split.get("train", 0)
        rejected = sum(self.rejected_by_reason.values())
        counts = {
            "rows_read": self.rows_read,
            "rows_written": sum(self.rows_by_split.values()),
            "rows_rejected": rejected,
            "rejected_by_reason": dict(sorted(self.rejected_by_reason.items())),
            "crlf_lines_accepted": self.crlf_lines,
            "empty_files": sorted(self.empty_files),
        }
        dense = {}
        moments = self.dense_moments()
        for j, name in enumerate(spec.dense):
            if moments.dense_count:
                dense[name] = {
                    "mean": float(moments.dense_mean[j]),
                    "std": float(np.sqrt(moments.dense_m2[j] / moments.dense_count)),
                    "min": float(moments.dense_min[j]),
                    "max": float(moments.dense_max[j]),
                }
            else:
                dense[name] = {"mean": 0.0, "std": 0.0, "min": 0.0, "max": 0.0}
        categorical = {}
        for feature in spec.categorical:
            sample = self.id_samples.get(feature.name)
            summary = sample.summary(train_rows) if sample is not None else {"distinct_estimate": 0}
            summary["missing_rate"] = self.categorical_missing.get(feature.name, 0) / max(
                train_rows, 1
            )
            categorical[feature.name] = summary
        stats = {
            "computed_on": "train",
            "rows": train_rows,
            "label_rate": self.label_sum / max(train_rows, 1),
            "dense": dense,
            "categorical": categorical,
        }
        return {"counts": counts, "stats": stats}


class DatasetStatsFn(beam.CombineFn):
    """Merges the `PartialStats` of all chunks into one."""

    def create_accumulator(self) -> PartialStats:
        return PartialStats()

    def add_input(self, accumulator: PartialStats, partial: PartialStats) -> PartialStats:
        return accumulator.merge(partial)

    def merge_accumulators(self, accumulators) -> PartialStats:
        result = PartialStats()
        for accumulator in accumulators:
            result.merge(accumulator)
        return result

    def extract_output(self, accumulator: PartialStats) -> PartialStats:
        return accumulator
