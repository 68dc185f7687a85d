"""The event-log job: logs of user actions -> user histories as Parquet list columns.

    ListChunks -> ParseEvents (per chunk: parse and hash in blocks, drop duplicates, keep
      each user's most recent events, write them per bucket of users under _temporary/)
      -> GatherChunks (GroupByKey, one key) -> PlanBuckets (merged chunk statistics; time
      formats checked across files; a time split's boundaries) -> DistributeBuckets
      (GroupByKey by bucket) -> BuildHistories (per bucket: every chunk's events of its
      users, ordered by time with the input position breaking ties, duplicates across
      chunks dropped, users below min_events left out, cut into the split's examples)
      -> CombineStats -> WriteStats
    then, on the launcher: rename the buckets' files to SPLIT/part-NNNNN-of-MMMMM.parquet,
    the rejected rows' lines to file lines, write metadata.json and _SUCCESS last.

Buckets are users hashed into `ceil(input bytes / bucket bytes)` groups, so a worker holds
one bucket's events, never the whole input; a user's events all meet in one bucket. The
graph is built from Create, ParDo and GroupByKey only, like the click-log job, and every
step's output depends on the input alone: the DirectRunner and Dask write the same bytes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems
from hybridrec.common.errors import UserError
from hybridrec.pipeline import _chunks, _launch, _output, _parquet, hashing
from hybridrec.pipeline._errors import InputError
from hybridrec.pipeline.click_job import PreprocessResult
from hybridrec.pipeline.config import PreprocessConfig
from hybridrec.pipeline.events import _event_inputs, _event_output, _event_read
from hybridrec.pipeline.events._event_output import ITEMS
from hybridrec.pipeline.events._event_parse import EventParser
from hybridrec.pipeline.events._histories import Events, build_bucket, prune_chunk, split_encodings
from hybridrec.pipeline.events.event_spec import EventSpec, load_event_spec, parse_width
from hybridrec.pipeline.events.event_stats import EventStats

_ALL = 0
OUTPUTS = ("metadata.json", "train", "valid", "test", "rejected", ITEMS) + tuple(
    f"window_{w}" for w in range(1, 33)
)


@dataclasses.dataclass(frozen=True)
class ChunkDone:
    """A parsed chunk: its statistics, the buckets it wrote events to and those it wrote
    item names to."""

    chunk: _chunks.Chunk
    stats: EventStats
    buckets: tuple[int, ...]
    item_buckets: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """What one bucket's builder needs: the chunks that wrote to it and the boundaries."""

    bucket: int
    chunk_keys: tuple[str, ...]
    boundaries: tuple[int, ...] | None
    chunk_stats: EventStats | None  # the merged chunk statistics (carried by one bucket)
    item_chunk_keys: tuple[str, ...] = ()  # the chunks that wrote item names to the bucket


def _temp(temp_dir: str, kind: str, bucket: int, key: str) -> str:
    return FileSystems.join(temp_dir, kind, f"b{bucket:05d}", f"chunk-{key}.arrow")


def _write_arrow(path: str, table: pa.Table) -> None:
    with FileSystems.create(path) as handle:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        handle.write(sink.getvalue().to_pybytes())


def _read_arrow(path: str) -> pa.Table:
    with FileSystems.open(path) as handle:
        return pa.ipc.open_file(pa.py_buffer(handle.read())).read_all()


def bucket_of(users: np.ndarray, buckets: int) -> np.ndarray:
    """The bucket of each user id (the same on every machine)."""
    return (hashing.splitmix64(users) % np.uint64(buckets)).astype(np.int64)


class _ParseEventsFn(beam.DoFn):
    """Parses one chunk, keeps each user's most recent events, writes them by bucket."""

    def __init__(self, spec, *, temp_dir, block_bytes, buckets, progress_dir):
        self.spec = spec
        self.temp_dir = temp_dir
        self.block_bytes = block_bytes
        self.buckets = buckets
        self.progress_dir = progress_dir
        self.events_read = beam.metrics.Metrics.counter("preprocess", "events_read")
        self.rows_rejected = beam.metrics.Metrics.counter("preprocess", "rows_rejected")

    def setup(self):
        self.parser = EventParser(self.spec)

    def process(self, chunk: _chunks.Chunk):
        progress = _event_read.progress_file(self.progress_dir, chunk)
        read = _event_read.read_chunk_events(chunk, self.spec, self.parser, self.block_bytes, progress)  # fmt: skip
        stats, rejected = read.stats, read.rejected
        pruned = prune_chunk(read.events, self.spec)
        stats.duplicates = pruned.duplicates
        # the raw ids of the users cut to the limit: maybe capped
        names = read.user_names(set(pruned.users[pruned.over_limit].tolist()))
        written = self._write(chunk, pruned, names)
        item_buckets = self._write_item_names(chunk, read)
        if rejected:
            path = FileSystems.join(self.temp_dir, "rejected", f"chunk-{chunk.key}.jsonl")
            with FileSystems.create(path) as handle:
                handle.write("".join(json.dumps(r) + "\n" for r in rejected).encode())
            stats.files.append(("rejected", chunk.key, len(rejected)))
        self.events_read.inc(stats.events)
        self.rows_rejected.inc(len(rejected))
        yield _ALL, ChunkDone(chunk, stats, written, item_buckets)

    def _write(self, chunk, pruned, names) -> tuple[int, ...]:
        """The chunk's kept events and its users' counts, one Arrow file each per bucket."""
        events, users, counts = pruned.events, pruned.users, pruned.counts
        event_bucket = bucket_of(events.users, self.buckets)
        user_bucket = bucket_of(users, self.buckets)
        written = []
        for bucket in np.unique(user_bucket):
            part = events.take(np.flatnonzero(event_bucket == bucket))
            _write_arrow(_temp(self.temp_dir, "events", int(bucket), chunk.key), part.to_table())
            mine = np.flatnonzero(user_bucket == bucket)
            named = [names.get(int(user), "") for user in users[mine]]
            table = pa.table({"user": users[mine], "count": counts[mine], "name": named})
            _write_arrow(_temp(self.temp_dir, "users", int(bucket), chunk.key), table)
            written.append(int(bucket))
        return tuple(written)

    def _write_item_names(self, chunk, read: _event_read.ChunkEvents) -> tuple[int, ...]:
        """The raw id of each item at its first occurrence in the chunk, by item bucket."""
        ids, names = read.item_names()
        item_bucket = bucket_of(ids, self.buckets)
        written = []
        for bucket in np.unique(item_bucket):
            mine = np.flatnonzero(item_bucket == bucket)
            table = pa.table({"item": ids[mine], "name": names.take(pa.array(mine))})
            _write_arrow(_temp(self.temp_dir, ITEMS, int(bucket), chunk.key), table)
            written.append(int(bucket))
        return tuple(written)


def plan_buckets(spec: EventSpec, done: Iterable[ChunkDone]):
    """Every parsed chunk -> (bucket, BucketPlan) for each bucket some chunk wrote to."""
    done = sorted(done, key=lambda d: (d.chunk.file_index, d.chunk.chunk_index))
    merged = EventStats()
    for item in done:
        merged.merge(item.stats)
    formats = {f: path for f, path in merged.time_formats.items() if f != "timestamp"}
    if len(formats) > 1:
        (first, a), (second, b) = list(formats.items())[:2]
        raise InputError(
            f"the time column mixes formats between files: {a} holds {first} times, {b} "
            f"{second}; write one format, or set time_format in the spec"
        )
    boundaries = _boundaries(spec, merged)
    chunks_of: dict[int, list[str]] = {}
    item_chunks_of: dict[int, list[str]] = {}
    for item in done:
        for bucket in item.buckets:
            chunks_of.setdefault(bucket, []).append(item.chunk.key)
        for bucket in item.item_buckets:
            item_chunks_of.setdefault(bucket, []).append(item.chunk.key)
    if not chunks_of and not item_chunks_of:
        yield -1, BucketPlan(-1, (), boundaries, merged)
        return
    for index, bucket in enumerate(sorted(set(chunks_of) | set(item_chunks_of))):
        stats = merged if index == 0 else None
        plan = BucketPlan(
            bucket,
            tuple(chunks_of.get(bucket, ())),
            boundaries,
            stats,
            tuple(item_chunks_of.get(bucket, ())),
        )
        yield bucket, plan


def _boundaries(spec: EventSpec, stats: EventStats) -> tuple[int, ...] | None:
    if spec.split.kind != "time":
        return None
    if spec.split.boundaries:
        return tuple(spec.split.boundaries)
    if stats.time_max is None:
        return None
    width = parse_width(spec.split.width)
    end = stats.time_max + 1  # the last window ends just after the last event
    windows = spec.split.windows
    return tuple(end - (windows - k) * width for k in range(windows + 1))


class _BuildHistoriesFn(beam.DoFn):
    """One bucket: its events from every chunk -> its examples, one Parquet file a split."""

    def __init__(self, spec, *, temp_dir, compression):
        self.spec = spec
        self.temp_dir = temp_dir
        self.compression = compression

    def setup(self):
        self.item_features = (
            _event_inputs.shared_item_features(self.spec) if self.spec.items else None
        )

    def process(self, keyed):
        for plan in keyed[1]:
            yield _ALL, self._build(plan)

    def _build(self, plan: BucketPlan) -> EventStats:
        stats = EventStats()
        if plan.chunk_stats is not None:
            stats.merge(plan.chunk_stats)
        if plan.bucket < 0:
            return stats
        if plan.item_chunk_keys:
            stats.files.append(self._item_names(plan))
        if not plan.chunk_keys:
            return stats
        event_tables, user_tables = [], []
        for key in plan.chunk_keys:
            event_tables.append(_read_arrow(_temp(self.temp_dir, "events", plan.bucket, key)))
            user_tables.append(_read_arrow(_temp(self.temp_dir, "users", plan.bucket, key)))
        events = Events.from_table(pa.concat_tables(event_tables))
        users = pa.concat_tables(user_tables)
        named = users.filter(pc.greater(pc.utf8_length(users.column("name")), 0))
        names = dict(
            zip(named.column("user").to_pylist(), named.column("name").to_pylist(), strict=True)
        )
        boundaries = None if plan.boundaries is None else np.asarray(plan.boundaries, np.int64)
        tables, built = build_bucket(
            events,
            users.column("user").to_numpy(),
            users.column("count").to_numpy(),
            names,
            self.spec,
            boundaries,
            self.item_features,
        )
        for split, table in tables.items():
            if not table.num_rows:
                continue
            path = FileSystems.join(self.temp_dir, split, f"part-{plan.bucket:05d}.parquet")
            with FileSystems.create(path) as handle:
                pq.write_table(
                    table, handle, compression=self.compression, **split_encodings(table)
                )
            built.files.append((split, f"{plan.bucket:05d}", table.num_rows))
        return stats.merge(built)

    def _item_names(self, plan: BucketPlan) -> tuple[str, str, int]:
        """The bucket's items, each named by its first occurrence in input order."""
        tables = [
            _read_arrow(_temp(self.temp_dir, ITEMS, plan.bucket, key))
            for key in plan.item_chunk_keys  # in input order (plan_buckets)
        ]
        table = pa.concat_tables(tables)
        ids = table.column("item").to_numpy()
        order = np.argsort(ids, kind="stable")  # stable: the first chunk's name first
        first = order[np.unique(ids[order], return_index=True)[1]]
        table = table.take(pa.array(first))
        path = FileSystems.join(self.temp_dir, ITEMS, f"part-{plan.bucket:05d}.parquet")
        with FileSystems.create(path) as handle:
            pq.write_table(table, handle, compression=self.compression)
        return ITEMS, f"{plan.bucket:05d}", table.num_rows


def _merge_stats(group) -> EventStats:
    merged = EventStats()
    # in bucket order (the statistics of the chunks come with the first bucket), so that
    # lists and first-seen names merge the same way on every runner
    for stats in sorted(group[1], key=lambda s: min((k for _, k, _ in s.files), default="")):
        merged.merge(stats)
    return merged


class _WriteStatsFn(beam.DoFn):
    def __init__(self, temp_dir: str):
        self.temp_dir = temp_dir

    def process(self, stats: EventStats):
        _output.write_stats(self.temp_dir, stats)
        yield stats.events


class EventHistories(beam.PTransform):
    """Chunks -> every bucket's split files under `temp_dir` + one merged EventStats."""

    def __init__(self, spec: EventSpec, *, temp_dir, block_bytes, buckets, compression, progress_dir):  # fmt: skip
        super().__init__()
        self.spec = spec
        self.parse_fn = _ParseEventsFn(
            spec,
            temp_dir=temp_dir,
            block_bytes=block_bytes,
            buckets=buckets,
            progress_dir=progress_dir,
        )
        self.build_fn = _BuildHistoriesFn(spec, temp_dir=temp_dir, compression=compression)

    def expand(self, chunks):
        spec = self.spec
        return (
            chunks
            | "ParseEvents" >> beam.ParDo(self.parse_fn)
            | "GatherChunks" >> beam.GroupByKey()
            | "PlanBuckets" >> beam.FlatMap(lambda group: plan_buckets(spec, group[1]))
            | "DistributeBuckets" >> beam.GroupByKey()
            | "BuildHistories" >> beam.ParDo(self.build_fn)
            | "GatherStats" >> beam.GroupByKey()
            | "CombineStats" >> beam.Map(_merge_stats)
        )


def run_event_preprocess(
    config: PreprocessConfig, *, beam_args: Sequence[str] = (), quiet: bool = False
):
    """Runs the event-log job: Beam pipeline, then file names, metadata.json and `_SUCCESS`.

    Raises:
        UserError: as `pipeline.run_preprocess`, and for an event log: input whose columns
            do not match the spec, a time column mixing formats, a non-integer token in the
            user-per-line form, an empty input, or no user with enough events.
    """
    spec = load_event_spec(config.spec)
    chunks = _chunks.list_chunks(
        config.inputs, config.chunk_bytes, input_format=config.input_format
    )
    for chunk in chunks:
        if chunk.format == "parquet" and chunk.chunk_index == 0:
            with _parquet.open_file(chunk.path) as parquet_file:
                try:
                    _event_inputs.check_event_schema(parquet_file.schema_arrow, spec, chunk.path)
                except InputError as error:
                    raise UserError(error.plain) from None
    if spec.format == "delimited":
        _chunks.check_headers(chunks, spec, config.spec)
    if spec.items is not None:
        try:  # a bad items file stops the job before it starts
            _event_inputs.load_item_features(spec)
        except InputError as error:
            raise UserError(error.plain) from None
    total = sum(chunk.input_bytes for chunk in chunks)
    buckets = max(1, math.ceil(total / (config.bucket_mb * 2**20)))

    def build(pipeline, temp_dir: str, progress_dir: str | None) -> None:
        _ = (
            pipeline
            | "ListChunks" >> beam.Create(chunks)
            | "EventHistories"
            >> EventHistories(
                spec,
                temp_dir=temp_dir,
                block_bytes=config.block_bytes,
                buckets=buckets,
                compression=config.compression,
                progress_dir=progress_dir,
            )
            | "WriteStats" >> beam.ParDo(_WriteStatsFn(temp_dir))
        )

    temp_dir, progress, runner_line = _launch.run_job(
        config, chunks, build, beam_args=beam_args, quiet=quiet, outputs=OUTPUTS
    )
    stats = _output.read_stats(temp_dir)
    boundaries = _boundaries(spec, stats)
    meta = _event_output.publish(
        config, spec, chunks, temp_dir, stats, runner_line, outputs=OUTPUTS, boundaries=boundaries
    )
    progress.count = progress.total
    progress.close(
        rows=stats.lines, rejected=sum(stats.rejected_by_reason.values()), users=stats.users
    )
    return PreprocessResult(config.output, meta, progress.elapsed)
