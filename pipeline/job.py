"""The preprocessing job: raw click logs -> sharded Parquet (`hybridrec preprocess` runs it).

    ListChunks -> CountLines -> GatherCounts (GroupByKey, one key) -> PlaceChunks
      (first line of each chunk in its file and in the input, total lines)
      -> DistributeChunks (GroupByKey by chunk) -> ParseHashWrite (batched numpy/pyarrow
      per block; Parquet per chunk and split, rejected rows per chunk, under _temporary/)
      -> CombineStats (CombinePerKey) -> WriteStats (OUT/_temporary/stats.pickle)
    then, on the launcher: rename chunk files to part-NNNNN-of-MMMMM.parquet in input
    order, write metadata.json, and write _SUCCESS last.

The job is one chain with one sink at its end, built only from Create, ParDo and
GroupByKey, without side inputs or multi-output ParDos: the transforms every Beam runner
translates. A runner that runs the last step has run every step (the DaskRunner computes
only the last step's graph; see docs/pipeline.md, "Runners"). Runs on the DirectRunner
with one worker process per core by default, on Dask with `runner="dask"`, and on any
other runner (Dataflow, Flink, Spark) through standard Beam pipeline options.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Iterable, Sequence


class _DropImportNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "apitools not found" not in record.getMessage()


# Beam's GCP module warns about optional client libraries at import; irrelevant here.
_import_filter = _DropImportNoise()
logging.getLogger().addFilter(_import_filter)
import apache_beam as beam  # noqa: E402

logging.getLogger().removeFilter(_import_filter)
from apache_beam.io.filesystems import FileSystems  # noqa: E402
from apache_beam.metrics import Metrics  # noqa: E402

from common.errors import UserError  # noqa: E402
from common.progress import Progress  # noqa: E402
from pipeline import _chunks, _errors, _output, _parquet, runners  # noqa: E402
from pipeline._parse import BlockParser  # noqa: E402
from pipeline.config import PreprocessConfig  # noqa: E402
from pipeline.spec import FeatureSpec, load_spec  # noqa: E402
from pipeline.stats import DatasetStatsFn, PartialStats  # noqa: E402

# Every line count meets every other under this one key (a global gather by GroupByKey).
_ALL = 0


@dataclasses.dataclass(frozen=True)
class PlacedChunk:
    """A chunk with the line numbers it needs: where it starts and how long the input is."""

    chunk: _chunks.Chunk
    first_line: int  # 0-based line index of the chunk's first line within its file
    global_first_line: int  # the same, counted over all input files in order
    total_lines: int  # lines (Parquet: rows) of the whole input


class _CountLinesFn(beam.DoFn):
    def __init__(self, block_bytes: int):
        self.block_bytes = block_bytes

    def process(self, chunk: _chunks.Chunk):
        yield _ALL, (chunk, _chunks.count_lines(chunk, self.block_bytes))


def place_chunks(counts: Iterable[tuple[_chunks.Chunk, int]]):
    """(chunk, lines) of every chunk -> ((file index, chunk index), PlacedChunk) per chunk."""
    ordered = sorted(counts, key=lambda item: (item[0].file_index, item[0].chunk_index))
    total = sum(lines for _, lines in ordered)
    global_line, file_index, file_line = 0, None, 0
    for chunk, lines in ordered:
        if chunk.file_index != file_index:
            file_index, file_line = chunk.file_index, 0
        placed = PlacedChunk(chunk, file_line, global_line, total)
        yield (chunk.file_index, chunk.chunk_index), placed
        file_line += lines
        global_line += lines


class _ProcessChunkFn(beam.DoFn):
    """Parses, validates, hashes, splits and writes one chunk; emits its statistics."""

    def __init__(
        self, spec, *, split_mode, eval_fraction, temp_dir, block_bytes, compression, progress_dir
    ):
        self.spec = spec
        self.split_mode = split_mode
        self.eval_fraction = eval_fraction
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

    def process(self, keyed: tuple[tuple[int, int], Iterable[PlacedChunk]]):
        for placed in keyed[1]:
            yield _ALL, self._process(placed)

    def _process(self, placed: PlacedChunk) -> PartialStats:
        chunk, total = placed.chunk, placed.total_lines
        split = _chunks.SplitRule(
            self.split_mode,
            self.eval_fraction,
            eval_start_line=total - int(round(total * self.eval_fraction)),
        )
        progress_path = (
            os.path.join(self.progress_dir, f"chunk-{chunk.key}.json")
            if self.progress_dir
            else None
        )
        stats, rejected = _chunks.process_chunk(
            chunk,
            spec=self.spec,
            parser=self.parser,
            first_line=placed.first_line,
            global_first_line=placed.global_first_line,
            split=split,
            temp_dir=self.temp_dir,
            block_bytes=self.block_bytes,
            compression=self.compression,
            progress_path=progress_path,
            parquet_parser=self.parquet_parser,
        )
        if rejected:
            path = FileSystems.join(self.temp_dir, "rejected", f"chunk-{chunk.key}.jsonl")
            with FileSystems.create(path) as handle:
                handle.write("".join(f"{line}\n" for line in rejected).encode())
            stats.files.append(("rejected", chunk.key, len(rejected)))
        self.rows_read.inc(stats.rows_read)
        self.rows_written.inc(sum(stats.rows_by_split.values()))
        self.rows_rejected.inc(len(rejected))
        return stats


class Preprocess(beam.PTransform):
    """Chunks -> Parquet and rejected-row files under `temp_dir` + one combined PartialStats.

    Writes `<temp_dir>/{train,eval}/chunk-KEY.parquet` and, for chunks with rejected rows,
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
    ):
        super().__init__()
        self.block_bytes = block_bytes
        self.process_fn = _ProcessChunkFn(
            spec,
            split_mode=split_mode,
            eval_fraction=eval_fraction,
            temp_dir=temp_dir,
            block_bytes=block_bytes,
            compression=compression,
            progress_dir=progress_dir,
        )

    def expand(self, chunks):
        return (
            chunks
            | "CountLines" >> beam.ParDo(_CountLinesFn(self.block_bytes))
            | "GatherCounts" >> beam.GroupByKey()
            | "PlaceChunks" >> beam.FlatMap(lambda group: place_chunks(group[1]))
            # A GroupByKey, not a Reshuffle: runners that treat Reshuffle as a no-op (Dask)
            # would otherwise parse every chunk in the one task that placed them.
            | "DistributeChunks" >> beam.GroupByKey()
            | "ParseHashWrite" >> beam.ParDo(self.process_fn)
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
            is written then, and a failed run leaves no partial output files.
    """
    runner = runners.resolve_runner(config.runner)
    dask = runners.runner_kind(runner) == "dask"
    spec = load_spec(config.spec)
    chunks = _chunks.list_chunks(
        config.inputs, config.chunk_bytes, spec=spec, input_format=config.input_format
    )
    if dask and config.dask_address:  # before the output is touched
        runners.check_dask_scheduler(config.dask_address, config.dask_timeout)
    out = config.output
    _output.prepare(out, config.overwrite)
    temp_dir = FileSystems.join(out, _output.TEMP_DIR)
    local = "://" not in out
    progress_dir = os.path.join(temp_dir, "progress") if local else None
    if progress_dir:
        os.makedirs(progress_dir, exist_ok=True)
    log_path = os.path.join(temp_dir, _output.LOG_FILE) if local else None
    with contextlib.ExitStack() as stack:
        terminal = stack.enter_context(_stderr_to_file(log_path))
        stream = open(os.devnull, "w") if quiet else terminal  # noqa: SIM115
        cluster = None
        if dask:
            cluster = stack.enter_context(
                runners.dask_cluster(
                    config.dask_address, workers=config.dask_workers, timeout=config.dask_timeout
                )
            )
            if cluster.local:
                print(
                    f"[preprocess] Dask local cluster: {cluster.workers} worker process(es), "
                    f"dashboard {cluster.dashboard or 'unavailable (pip install bokeh)'}",
                    file=stream,
                    flush=True,
                )
        options = runners.pipeline_options(
            beam_args,
            [chunk.input_bytes for chunk in chunks],
            runner=runner,
            dask_address=cluster.address if cluster else None,
            dask_timeout=config.dask_timeout,
        )
        pipeline = beam.Pipeline(options=options)
        _ = (
            pipeline
            | "ListChunks" >> beam.Create(chunks)
            | "Preprocess"
            >> Preprocess(
                spec,
                split_mode=config.split,
                eval_fraction=config.eval_fraction,
                temp_dir=temp_dir,
                block_bytes=config.block_bytes,
                compression=config.compression,
                progress_dir=progress_dir,
            )
            | "WriteStats" >> beam.ParDo(_WriteStatsFn(temp_dir))
        )
        total_bytes = sum(chunk.input_bytes for chunk in chunks)
        try:
            progress = _run_with_progress(pipeline, progress_dir, total_bytes, stream)
        except BaseException:
            _output.discard_partial(temp_dir)
            if log_path and os.path.exists(log_path):
                print(f"hybridrec preprocess: Beam worker log: {log_path}", file=terminal)
            raise
        runner_line = runners.describe_runner(options, cluster)
    progress.stream = stream if quiet else sys.stderr
    return _publish(config, spec, chunks, temp_dir, progress, runner_line)


def _publish(config, spec, chunks, temp_dir, progress, runner_line) -> PreprocessResult:
    out = config.output
    stats = _output.read_stats(temp_dir)
    rejected_files = _output.publish_rejected(out, temp_dir, stats)
    if stats.rows_read == 0:
        raise UserError(f"no input rows: every input file is empty ({', '.join(config.inputs)})")
    if not sum(stats.rows_by_split.values()):
        raise UserError(f"every input row was rejected; see {FileSystems.join(out, 'rejected')}")
    meta = _output.finalize(
        out,
        temp_dir,
        spec,
        stats,
        config,
        runner=runner_line,
        input_files=list(dict.fromkeys(chunk.path for chunk in chunks)),
        rejected_files=rejected_files,
    )
    counts = meta["counts"]
    progress.close(rows=counts["rows_read"], rejected=counts["rows_rejected"])
    return PreprocessResult(out, meta, progress.elapsed)


@contextlib.contextmanager
def _stderr_to_file(path: str | None):
    """Sends file descriptor 2 (inherited by worker processes) to `path`.

    Beam's and Dask's worker processes log start-up chatter to stderr; it goes to a log
    file so the terminal shows only progress and the summary. Yields a stream to the
    real stderr.
    """
    if path is None:
        yield sys.stderr
        return
    sys.stderr.flush()
    saved = os.dup(2)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 2)
    os.close(log)
    terminal = os.fdopen(os.dup(saved), "w")
    try:
        yield terminal
    finally:
        terminal.flush()
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        terminal.close()


def _run_with_progress(pipeline, progress_dir: str | None, total_bytes: int, stream) -> Progress:
    """Runs the pipeline; on a local output, shows progress from the workers' progress files."""
    failure: list[BaseException] = []

    def run():
        result = None
        try:
            result = pipeline.run()
            result.wait_until_finish()
        except BaseException as error:  # re-raised on the calling thread
            failure.append(error)
        finally:
            runners.close_runner_client(result)

    progress = Progress("preprocess", total=max(total_bytes // 2**20, 1), unit="MB", stream=stream)
    thread = threading.Thread(target=run, name="beam-pipeline", daemon=True)
    thread.start()
    done_mb = 0
    while thread.is_alive():
        thread.join(timeout=1.0)
        if progress_dir and os.path.isdir(progress_dir):
            consumed, lines, rejected = _read_progress(progress_dir)
            mb = consumed // 2**20
            progress.update(mb - done_mb, rows=lines, rejected=rejected)
            done_mb = mb
    if failure:
        error = failure[0]
        match = re.search(
            rf"\[{_errors.INPUT_ERROR_MARK}\] (.*?) \[/{_errors.INPUT_ERROR_MARK}\]",
            str(error),
            re.S,
        )
        if match:
            raise UserError(match.group(1)) from None
        raise error
    return progress


def _read_progress(progress_dir: str) -> tuple[int, int, int]:
    """(input bytes consumed, lines read, rows rejected) over all chunks so far."""
    consumed, lines, rejected = 0, 0, 0
    for name in os.listdir(progress_dir):
        try:
            with open(os.path.join(progress_dir, name)) as handle:
                state = json.load(handle)
        except (OSError, ValueError):
            continue  # being replaced right now
        consumed += state["bytes"]
        lines += state["lines"]
        rejected += state.get("rejected", 0)
    return consumed, lines, rejected
