"""The preprocessing job: raw click logs -> sharded Parquet (`hybridrec preprocess` runs it).

    ListChunks -> ParseHashWrite (per chunk: batched numpy/pyarrow per block; Parquet,
      rejected rows and statistics per chunk under _temporary/, chunk-local line numbers)
      -> GatherCounts (GroupByKey, one key) -> PlaceChunks (first line of each chunk in
      its file and in the input, total lines) -> DistributeChunks (GroupByKey by chunk)
      -> PlaceRows (file line numbers for rejected rows; position split: whole chunks to
      eval, the boundary chunk split) -> CombineStats (CombinePerKey)
      -> WriteStats (OUT/_temporary/stats.pickle)
    then, on the launcher: rename chunk files to part-NNNNN-of-MMMMM.parquet in input
    order, write metadata.json, and write _SUCCESS last.

The job is one chain with one sink at its end, built only from Create, ParDo and
GroupByKey, without side inputs or multi-output ParDos: the transforms every Beam runner
translates. A runner that runs the last step has run every step (the DaskRunner computes
only the last step's graph; see docs/pipeline.md, "Runners"). Runs on the DirectRunner
with a worker thread per core by default, on Dask with `runner="dask"`, and on any
other runner (Dataflow, Flink, Spark) through standard Beam pipeline options.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from collections.abc import Iterable, Sequence

import apache_beam as beam
import numpy as np
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from hybridrec.pipeline import _chunks, _launch, _output, _parquet, _placement, _splits
from hybridrec.pipeline._parse import BlockParser
from hybridrec.pipeline.config import PreprocessConfig
from hybridrec.pipeline.spec import FeatureSpec, load_spec
from hybridrec.pipeline.stats import DatasetStatsFn, PartialStats

# Every chunk's line count meets every other under this one key (a global gather).
_ALL = 0


@dataclasses.dataclass(frozen=True)
class ParsedChunk:
    """What the parse step reports about a chunk: how many lines it has."""

    chunk: _chunks.Chunk
    lines: int  # lines (Parquet: rows) of the chunk, a header line included


@dataclasses.dataclass(frozen=True)
class PlacedChunk:
    """A parsed chunk and where its lines sit in its file and in the whole input."""

    chunk: _chunks.Chunk
    lines: int  # lines of the chunk
    first_line: int  # 0-based line index of the chunk's first line within its file
    global_first_line: int  # the same, counted over all input files in order
    total_lines: int  # lines (Parquet: rows) of the whole input


def place_chunks(parsed: Iterable[ParsedChunk]):
    """Every parsed chunk -> ((file index, chunk index), PlacedChunk), in input order."""
    ordered = sorted(parsed, key=lambda item: (item.chunk.file_index, item.chunk.chunk_index))
    total = sum(item.lines for item in ordered)
    global_line, file_index, file_line = 0, None, 0
    for item in ordered:
        if item.chunk.file_index != file_index:
            file_index, file_line = item.chunk.file_index, 0
        placed = PlacedChunk(item.chunk, item.lines, file_line, global_line, total)
        yield (item.chunk.file_index, item.chunk.chunk_index), placed
        file_line += item.lines
        global_line += item.lines


def _temp_path(temp_dir: str, kind: str, key: str, extension: str) -> str:
    return FileSystems.join(temp_dir, kind, f"chunk-{key}.{extension}")


class _ParseChunkFn(beam.DoFn):
    """Parses, validates, hashes and writes one chunk, with chunk-local line numbers.

    Before the input's line count is known, a position split cannot be decided: every
    row goes to train, and `_PlaceRowsFn` moves the tail to eval. A hash split is final.
    The chunk's statistics and rejected rows go to files under the temp directory.
    """

    def __init__(self, spec, *, split_mode, eval_fraction, valid_fraction, temp_dir, block_bytes, compression, progress_dir):  # fmt: skip
        self.spec = spec
        self.split_mode = split_mode
        self.eval_fraction = eval_fraction
        self.valid_fraction = valid_fraction
        self.temp_dir = temp_dir
        self.block_bytes = block_bytes
        self.compression = compression
        self.progress_dir = progress_dir
        self.rows_read = Metrics.counter("preprocess", "rows_read")
        self.rows_written = Metrics.counter("preprocess", "rows_written")
        self.rows_rejected = Metrics.counter("preprocess", "rows_rejected")

    def setup(self):
        self.parser = BlockParser(self.spec)
        self.parquet_parser = _parquet.ParquetParser(self.spec)

    def process(self, chunk: _chunks.Chunk):
        if self.split_mode == "hash":  # final here
            split = _splits.SplitRule(
                "hash", self.eval_fraction, eval_start_line=0, valid_fraction=self.valid_fraction
            )
        else:  # every row to train for now: `_PlaceRowsFn` moves the tail to valid and eval
            split = _splits.SplitRule("position", self.eval_fraction, eval_start_line=2**62)
        progress_path = (
            os.path.join(self.progress_dir, f"chunk-{chunk.key}.json")
            if self.progress_dir
            else None
        )
        stats, rejected = _chunks.process_chunk(
            chunk,
            spec=self.spec,
            parser=self.parser,
            first_line=0,
            global_first_line=0,
            split=split,
            temp_dir=self.temp_dir,
            block_bytes=self.block_bytes,
            compression=self.compression,
            progress_path=progress_path,
            parquet_parser=self.parquet_parser,
        )
        if rejected:
            with FileSystems.create(
                _temp_path(self.temp_dir, "rejected", chunk.key, "jsonl")
            ) as handle:
                handle.write("".join(f"{line}\n" for line in rejected).encode())
            stats.files.append(("rejected", chunk.key, len(rejected)))
        with FileSystems.create(_temp_path(self.temp_dir, "stats", chunk.key, "pickle")) as handle:
            handle.write(pickle.dumps(stats))
        self.rows_read.inc(stats.rows_read)
        self.rows_written.inc(sum(stats.rows_by_split.values()))
        self.rows_rejected.inc(len(rejected))
        yield _ALL, ParsedChunk(chunk, stats.lines)


class _PlaceRowsFn(beam.DoFn):
    """Gives a parsed chunk its final line numbers and split; emits its statistics.

    Rejected rows get file line numbers (the chunk's first line added); under a position
    split a chunk past the eval (or valid) boundary moves there whole, and a chunk holding
    a boundary is split.
    """

    def __init__(self, spec, *, split_mode, eval_fraction, valid_fraction, temp_dir, compression):  # fmt: skip
        self.spec = spec
        self.split_mode = split_mode
        self.eval_fraction = eval_fraction
        self.valid_fraction = valid_fraction
        self.temp_dir = temp_dir
        self.compression = compression

    def setup(self):
        self.schema = BlockParser(self.spec).schema

    def process(self, keyed: tuple[tuple[int, int], Iterable[PlacedChunk]]):
        for placed in keyed[1]:
            yield _ALL, self._place(placed)

    def _place(self, placed: PlacedChunk) -> PartialStats:
        key = placed.chunk.key
        with FileSystems.open(_temp_path(self.temp_dir, "stats", key, "pickle")) as handle:
            stats: PartialStats = pickle.loads(handle.read())
        rejected_lines = self._renumber_rejected(placed, stats)
        if self.split_mode == "hash" or not stats.rows_by_split["train"]:
            return stats
        bounds = _splits.PositionSplit.of(
            placed.total_lines, self.eval_fraction, self.valid_fraction
        )
        first, last = placed.global_first_line, placed.global_first_line + placed.lines - 1
        whole = bounds.split_of(first)
        if whole == bounds.split_of(last):  # the chunk lies in one split
            return stats if whole == "train" else self._move(stats, key, whole)
        header = (
            self.spec.header and placed.chunk.format == "text" and placed.chunk.chunk_index == 0
        )
        row_lines = _placement.kept_lines(placed.lines, rejected_lines, header)
        starts = {"valid": bounds.valid_start, "eval": bounds.eval_start}
        if not self.valid_fraction:
            del starts["valid"]
        train = _placement.split_written_chunk(
            self.temp_dir, key, row_lines, {name: start - first for name, start in starts.items()},
            spec=self.spec, schema=self.schema, compression=self.compression,
        )  # fmt: skip
        return stats.with_train_stats_of(train)

    def _move(self, stats: PartialStats, key: str, split: str) -> PartialStats:
        """A chunk written to train, moved whole to `split` (its counts without train's
        statistics)."""
        if "://" not in self.temp_dir:
            os.makedirs(os.path.join(self.temp_dir, split), exist_ok=True)
        FileSystems.rename(
            [_temp_path(self.temp_dir, "train", key, "parquet")],
            [_temp_path(self.temp_dir, split, key, "parquet")],
        )
        moved = stats.counts_only()
        moved.rows_by_split = {"train": 0, "eval": 0, split: stats.rows_by_split["train"]}
        moved.files = [(split if f[0] == "train" else f[0], *f[1:]) for f in stats.files]
        return moved

    def _renumber_rejected(self, placed: PlacedChunk, stats: PartialStats) -> np.ndarray:
        """Adds the chunk's first line to its rejected rows; returns their chunk-local lines."""
        if not any(kind == "rejected" for kind, _, _ in stats.files):
            return np.zeros(0, np.int64)
        path = _temp_path(self.temp_dir, "rejected", placed.chunk.key, "jsonl")
        with FileSystems.open(path) as handle:
            records = [json.loads(line) for line in handle.read().decode().splitlines()]
        field = "row" if placed.chunk.format == "parquet" else "line"
        local = np.array([record[field] for record in records], np.int64)
        if placed.first_line:
            for record in records:
                record[field] += placed.first_line
            with FileSystems.create(path) as handle:
                handle.write("".join(json.dumps(r) + "\n" for r in records).encode())
        return local - (field == "line")  # text lines are 1-based in the records


class Preprocess(beam.PTransform):
    """Chunks -> Parquet and rejected-row files under `temp_dir` + one combined PartialStats.

    Writes `<temp_dir>/{train,valid,eval}/chunk-KEY.parquet` and, for chunks with rejected rows,
    `<temp_dir>/rejected/chunk-KEY.jsonl`; `PartialStats.files` lists them as
    (kind, chunk key, rows).

    Returns:
        A PCollection of one PartialStats: counts and statistics of the whole input.
    """

    def __init__(
        self,
        spec: FeatureSpec,
        *,
        split_mode,
        eval_fraction,
        temp_dir,
        block_bytes,
        compression="zstd",
        progress_dir=None,
        valid_fraction=0.0,
    ):
        super().__init__()
        self.parse_fn = _ParseChunkFn(
            spec,
            split_mode=split_mode,
            eval_fraction=eval_fraction,
            valid_fraction=valid_fraction,
            temp_dir=temp_dir,
            block_bytes=block_bytes,
            compression=compression,
            progress_dir=progress_dir,
        )
        self.place_fn = _PlaceRowsFn(
            spec,
            split_mode=split_mode,
            eval_fraction=eval_fraction,
            valid_fraction=valid_fraction,
            temp_dir=temp_dir,
            compression=compression,
        )

    def expand(self, chunks):
        return (
            chunks
            | "ParseHashWrite" >> beam.ParDo(self.parse_fn)
            | "GatherCounts" >> beam.GroupByKey()
            | "PlaceChunks" >> beam.FlatMap(lambda group: place_chunks(group[1]))
            # A GroupByKey, not a Reshuffle: runners that treat Reshuffle as a no-op (Dask)
            # would otherwise finish every chunk in the one task that placed them.
            | "DistributeChunks" >> beam.GroupByKey()
            | "PlaceRows" >> beam.ParDo(self.place_fn)
            | "CombineStats" >> beam.CombinePerKey(DatasetStatsFn())
            | "DropKey" >> beam.Values()
        )


class _WriteStatsFn(beam.DoFn):
    def __init__(self, temp_dir: str):
        self.temp_dir = temp_dir

    def process(self, stats: PartialStats):
        _output.write_stats(self.temp_dir, stats)
        yield stats.rows_read


@dataclasses.dataclass(frozen=True)
class PreprocessResult:
    """What `run_preprocess` did."""

    output: str  # the output directory
    metadata: dict  # the metadata.json it wrote
    seconds: float  # wall time of the whole job


def run_preprocess(
    config: PreprocessConfig, *, beam_args: Sequence[str] = (), quiet: bool = False
) -> PreprocessResult:
    """Runs the whole job: Beam pipeline, then file names, metadata.json and `_SUCCESS`.

    Args:
        config: inputs, output, spec, split, chunking and runner.
        beam_args: Beam pipeline options (`--direct_num_workers=2`, `--project=P`, ...),
            passed to `PipelineOptions` untouched.
        quiet: no progress lines on stderr.

    Raises:
        UserError: unknown spec or runner, missing input, an unreachable Dask scheduler,
            input that stops the job (truncated .gz, header mismatch), an existing
            complete output without `overwrite`, or no valid rows at all. No `_SUCCESS`
            is written then, a failed run leaves no partial output files, and a complete
            dataset already in the output stays as it was.
    """
    spec = load_spec(config.spec)
    chunks = _chunks.list_chunks(
        config.inputs, config.chunk_bytes, spec=spec, input_format=config.input_format
    )
    _chunks.check_headers(chunks, spec, config.spec)  # before the output is touched

    def build(pipeline, temp_dir: str, progress_dir: str | None) -> None:
        _ = (
            pipeline
            | "ListChunks" >> beam.Create(chunks)
            | "Preprocess"
            >> Preprocess(
                spec,
                split_mode=config.split,
                eval_fraction=config.eval_fraction,
                valid_fraction=config.valid_fraction,
                temp_dir=temp_dir,
                block_bytes=config.block_bytes,
                compression=config.compression,
                progress_dir=progress_dir,
            )
            | "WriteStats" >> beam.ParDo(_WriteStatsFn(temp_dir))
        )

    launched = _launch.run_job(config, chunks, build, beam_args=beam_args, quiet=quiet)
    return _publish(config, spec, chunks, *launched)


def _publish(config, spec, chunks, temp_dir, progress, runner_line) -> PreprocessResult:
    meta = _output.publish(
        config.output,
        temp_dir,
        spec,
        _output.read_stats(temp_dir),
        config,
        runner=runner_line,
        input_files=list(dict.fromkeys(chunk.path for chunk in chunks)),
    )
    counts = meta["counts"]
    progress.count = progress.total  # the run read its whole input
    progress.close(rows=counts["rows_read"], rejected=counts["rows_rejected"])
    return PreprocessResult(config.output, meta, progress.elapsed)
