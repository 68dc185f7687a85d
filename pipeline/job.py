"""The preprocessing job: raw click logs -> sharded Parquet (`hybridrec preprocess` runs it).

    ListChunks -> CountLines (side input: line offsets for line numbers and the split)
               -> ParseHashWrite (batched numpy/pyarrow per block; Parquet per chunk and split)
                    |-> rejected rows -> OUT/rejected/*.jsonl
                    '-> partial statistics -> CombineStats (CombineFn) -> OUT/_temporary/stats.json
    then, on the launcher: rename chunk files to part-NNNNN-of-MMMMM.parquet in input
    order, write metadata.json, and write _SUCCESS last.

Runs on the DirectRunner with one worker process per core by default; any other
runner (Dataflow, Flink, Spark) through standard Beam pipeline options, which are
passed through untouched (see docs/pipeline.md).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import os
import pickle
import re
import sys
import threading
from collections.abc import Sequence


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
from apache_beam.options.pipeline_options import (  # noqa: E402
    DirectOptions,
    PipelineOptions,
    StandardOptions,
    WorkerOptions,
)

from common.errors import UserError  # noqa: E402
from common.progress import Progress  # noqa: E402
from pipeline import _chunks, _errors, _parquet, hashing, metadata  # noqa: E402
from pipeline._parse import BlockParser  # noqa: E402
from pipeline.config import PreprocessConfig  # noqa: E402
from pipeline.spec import FeatureSpec, load_spec  # noqa: E402
from pipeline.stats import DatasetStatsFn, PartialStats  # noqa: E402

TEMP_DIR = "_temporary"


class _CountLinesFn(beam.DoFn):
    def __init__(self, block_bytes: int):
        self.block_bytes = block_bytes

    def process(self, chunk: _chunks.Chunk):
        yield chunk.key, _chunks.count_lines(chunk, self.block_bytes)


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

    def process(self, chunk: _chunks.Chunk, line_counts: dict):
        file_lines: dict[int, int] = {}
        before_in_file = 0
        for key, lines in line_counts.items():
            file_index, chunk_index = (int(part) for part in key.split("-"))
            file_lines[file_index] = file_lines.get(file_index, 0) + lines
            if file_index == chunk.file_index and chunk_index < chunk.chunk_index:
                before_in_file += lines
        before_files = sum(n for index, n in file_lines.items() if index < chunk.file_index)
        total = sum(file_lines.values())
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
            first_line=before_in_file,
            global_first_line=before_files + before_in_file,
            split=split,
            temp_dir=self.temp_dir,
            block_bytes=self.block_bytes,
            compression=self.compression,
            progress_path=progress_path,
            parquet_parser=self.parquet_parser,
        )
        self.rows_read.inc(stats.rows_read)
        self.rows_written.inc(sum(stats.rows_by_split.values()))
        self.rows_rejected.inc(len(rejected))
        for line in rejected:
            yield beam.pvalue.TaggedOutput("rejected", line)
        yield stats


class Preprocess(beam.PTransform):
    """Chunks -> Parquet files under `temp_dir` + rejected rows + one combined PartialStats.

    Returns:
        {"stats": PCollection of one PartialStats, "rejected": PCollection of JSON lines}.
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
        self.spec = spec
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
        line_counts = chunks | "CountLines" >> beam.ParDo(_CountLinesFn(self.block_bytes))
        results = chunks | "ParseHashWrite" >> beam.ParDo(
            self.process_fn, line_counts=beam.pvalue.AsDict(line_counts)
        ).with_outputs("rejected", main="stats")
        stats = results.stats | "CombineStats" >> beam.CombineGlobally(DatasetStatsFn())
        return {"stats": stats, "rejected": results.rejected}


# Below this much input, starting one Beam worker process per core (several seconds of
# CPU each) costs more than it saves; see docs/benchmarks.md.
MULTI_PROCESS_MIN_BYTES = 256 * 2**20


def pipeline_options(
    beam_args: Sequence[str], chunks: Sequence[_chunks.Chunk] = ()
) -> PipelineOptions:
    """Beam options from the pass-through flags, with a DirectRunner default that fits the input.

    Unless the flags say otherwise, the DirectRunner runs in `multi_processing` mode with
    one worker per core (at most one per chunk) when the input has several chunks and at
    least MULTI_PROCESS_MIN_BYTES, and `in_memory` with one worker otherwise.
    """
    options = PipelineOptions(list(beam_args))
    standard = options.view_as(StandardOptions)
    if standard.runner in (None, "DirectRunner", "direct"):
        standard.runner = standard.runner or "DirectRunner"
        direct = options.view_as(DirectOptions)
        total = sum(chunk.input_bytes for chunk in chunks)
        parallel = len(chunks) > 1 and total >= MULTI_PROCESS_MIN_BYTES
        if not any(arg.startswith("--direct_running_mode") for arg in beam_args):
            direct.direct_running_mode = "multi_processing" if parallel else "in_memory"
        if not any(arg.startswith("--direct_num_workers") for arg in beam_args):
            cores = os.cpu_count() or 1
            many = direct.direct_running_mode != "in_memory"
            direct.direct_num_workers = max(1, min(cores, len(chunks))) if many else 1
    harness = options.view_as(WorkerOptions)
    if not any(arg.startswith("--default_sdk_harness_log_level") for arg in beam_args):
        harness.default_sdk_harness_log_level = "ERROR"
    return options


def describe_runner(options: PipelineOptions) -> str:
    runner = options.view_as(StandardOptions).runner
    if runner in ("DirectRunner", "direct"):
        direct = options.view_as(DirectOptions)
        return f"{runner} ({direct.direct_running_mode}, {direct.direct_num_workers} worker(s))"
    return str(runner)


def _exists(path: str) -> bool:
    return FileSystems.exists(path)


def _prepare_output(out: str, overwrite: bool) -> None:
    success = FileSystems.join(out, metadata.SUCCESS_FILE)
    if _exists(success):
        if not overwrite:
            raise UserError(
                f"{out} already holds a complete dataset; pass --overwrite to replace it"
            )
        FileSystems.delete([success])  # from here on the directory is clearly incomplete
    stale = [
        FileSystems.join(out, name)
        for name in ("metadata.json", "train", "eval", "rejected", TEMP_DIR)
    ]
    stale = [path for path in stale if _exists(path)]
    if stale:
        FileSystems.delete(stale)
    if "://" not in out:
        if os.path.exists(out) and not os.path.isdir(out):
            raise UserError(f"--output {out} exists and is not a directory")
        os.makedirs(out, exist_ok=True)


@contextlib.contextmanager
def _stderr_to_file(path: str | None):
    """Sends file descriptor 2 (inherited by DirectRunner worker processes) to `path`.

    Beam's worker processes log start-up chatter to stderr; it goes to a log file so
    the terminal shows only progress and the summary. Yields a stream to the real stderr.
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


def _run_with_progress(pipeline, progress_dir: str | None, total_bytes: int, quiet: bool, log_path):
    """Runs the pipeline; on a local output, shows progress from the workers' progress files."""
    failure: list[BaseException] = []

    def run():
        try:
            pipeline.run().wait_until_finish()
        except BaseException as error:  # re-raised on the calling thread
            failure.append(error)

    with _stderr_to_file(log_path) as terminal:
        stream = open(os.devnull, "w") if quiet else terminal  # noqa: SIM115
        progress = Progress(
            "preprocess", total=max(total_bytes // 2**20, 1), unit="MB", stream=stream
        )
        thread = threading.Thread(target=run, name="beam-pipeline", daemon=True)
        thread.start()
        done_mb = 0
        while thread.is_alive():
            thread.join(timeout=1.0)
            if progress_dir and os.path.isdir(progress_dir):
                consumed, lines = _read_progress(progress_dir)
                mb = consumed // 2**20
                progress.update(mb - done_mb, lines=lines)
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
        if log_path:
            print(f"hybridrec preprocess: Beam worker log: {log_path}", file=sys.stderr)
        raise error
    progress.stream = sys.stderr if not quiet else progress.stream
    return progress


def _read_progress(progress_dir: str) -> tuple[int, int]:
    consumed, lines = 0, 0
    for name in os.listdir(progress_dir):
        try:
            with open(os.path.join(progress_dir, name)) as handle:
                state = json.load(handle)
        except (OSError, ValueError):
            continue  # being replaced right now
        consumed += state["bytes"]
        lines += state["lines"]
    return consumed, lines


def _finalize(
    out: str, temp_dir: str, spec, stats: PartialStats, config: PreprocessConfig, options, chunks
) -> dict:
    """Renames chunk files into their final names, writes metadata.json, then _SUCCESS."""
    splits = {}
    for split in ("train", "eval"):
        files = sorted((key, rows) for name, key, rows in stats.files if name == split)
        sources, targets, relative = [], [], []
        for index, (key, _) in enumerate(files):
            name = f"{split}/part-{index:05d}-of-{len(files):05d}.parquet"
            sources.append(FileSystems.join(temp_dir, split, f"chunk-{key}.parquet"))
            targets.append(FileSystems.join(out, name))
            relative.append(name)
        if sources:
            if "://" not in out:
                os.makedirs(os.path.join(out, split), exist_ok=True)
            FileSystems.rename(sources, targets)
        splits[split] = {"rows": sum(rows for _, rows in files), "files": relative}
    summary = stats.to_json(spec)
    meta = {
        "format_version": metadata.FORMAT_VERSION,
        "hash_scheme": hashing.hash_scheme(spec.prefix_bits),
        "spec": spec.to_json(),
        "splits": splits,
        "split_rule": {"mode": config.split, "eval_fraction": config.eval_fraction},
        "inputs": list(config.inputs),
        "input_format": config.input_format,
        "input_files": list(dict.fromkeys(chunk.path for chunk in chunks)),
        **summary,
        "rejected_files": sorted(
            "rejected/" + m.path.rsplit("/", 1)[-1]
            for m in FileSystems.match([FileSystems.join(out, "rejected", "*")])[0].metadata_list
        ),
        "runner": describe_runner(options),
    }
    with FileSystems.create(FileSystems.join(out, metadata.METADATA_FILE)) as handle:
        handle.write(json.dumps(meta, indent=1).encode())
    FileSystems.delete([temp_dir])
    with FileSystems.create(FileSystems.join(out, metadata.SUCCESS_FILE)) as handle:
        handle.write(b"")
    return meta


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
        UserError: unknown spec, missing input, input that stops the job (truncated .gz,
            header mismatch), an existing complete output without `overwrite`, or no
            valid rows at all. No `_SUCCESS` is written then.
    """
    spec = load_spec(config.spec)
    chunks = _chunks.list_chunks(
        config.inputs, config.chunk_bytes, spec=spec, input_format=config.input_format
    )
    out = config.output
    _prepare_output(out, config.overwrite)
    temp_dir = FileSystems.join(out, TEMP_DIR)
    local = "://" not in out
    progress_dir = os.path.join(temp_dir, "progress") if local else None
    if progress_dir:
        os.makedirs(progress_dir, exist_ok=True)
    options = pipeline_options(beam_args, chunks)
    stats_prefix = FileSystems.join(temp_dir, "stats")

    pipeline = beam.Pipeline(options=options)
    outputs = (
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
    )
    _ = (
        outputs["stats"]
        | "EncodeStats" >> beam.Map(lambda stats: _encode_stats(stats))
        | "WriteStats"
        >> beam.io.WriteToText(stats_prefix, shard_name_template="", file_name_suffix=".b64")
    )
    _ = outputs["rejected"] | "WriteRejected" >> beam.io.WriteToText(
        FileSystems.join(out, "rejected", "rejected"), file_name_suffix=".jsonl"
    )
    total_bytes = sum(chunk.input_bytes for chunk in chunks)
    direct = options.view_as(StandardOptions).runner in ("DirectRunner", "direct")
    log_path = os.path.join(temp_dir, "beam-workers.log") if local and direct else None
    progress = _run_with_progress(pipeline, progress_dir, total_bytes, quiet, log_path)

    with FileSystems.open(f"{stats_prefix}.b64") as handle:
        stats = _decode_stats(handle.read())
    if stats.rows_read == 0:
        raise UserError(f"no input rows: every input file is empty ({', '.join(config.inputs)})")
    if not sum(stats.rows_by_split.values()):
        raise UserError(f"every input row was rejected; see {FileSystems.join(out, 'rejected')}")
    meta = _finalize(out, temp_dir, spec, stats, config, options, chunks)
    progress.close(rows=meta["counts"]["rows_read"])
    return PreprocessResult(out, meta, progress.elapsed)


def _encode_stats(stats: PartialStats) -> str:
    # The combined statistics travel from the workers to the launcher as one text line.
    return base64.b64encode(pickle.dumps(stats)).decode()


def _decode_stats(data: bytes) -> PartialStats:
    return pickle.loads(base64.b64decode(data.strip()))
