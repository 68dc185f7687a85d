"""Follow mode: new complete input files -> micro-batch Parquet shards + an append-only manifest.

    poll the input globs ──► complete files (producer contract below) in arrival order
      ──► one bounded Beam run over them: ProcessFiles (parse, validate, hash, write a
          temporary shard per file with the reference's frozen spec and transforms)
      ──► on the launcher, file after file: rename the shard into `shards/`, then commit
          its manifest line (`pipeline.manifest`); unreadable files become dead letters

Why bounded runs in a loop and not one unbounded pipeline: apache-beam's Python
DirectRunner does not see files arriving through `fileio.MatchContinuously`, and the
Prism runner needs a download. A streaming runner (Dataflow, Flink, Prism) could run
the same per-file step under `MatchContinuously`; the manifest is what makes the
output exactly-once either way (docs/online.md).

Producer contract: a file counts once it is complete. Write it under a name the
glob does not match and rename it into place (atomic on one filesystem), or, with
`marker_suffix`, write `NAME<suffix>` after NAME. As a safety net a file is taken
only once its size and modification time stop changing for `settle_seconds`; one
still changing after `grow_timeout` seconds is a dead letter. Names must be unique:
a file already in the manifest is never read again.

Restart after a kill at any moment is idempotent: the manifest says which files are
done; shards and dead-letter copies past its last line are leftovers of an
uncommitted file and are written again under the same names.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from hybridrec.common.errors import UserError
from hybridrec.common.files import atomic_write_text, fsync_directory
from hybridrec.pipeline import _chunks, _splits, manifest, metadata
from hybridrec.pipeline._errors import InputError
from hybridrec.pipeline._parse import BlockParser
from hybridrec.pipeline.events.event_follow import EventFiles
from hybridrec.pipeline.rows import spec_from_json
from hybridrec.pipeline.runners import make_pipeline
from hybridrec.pipeline.spec import FeatureSpec

TEMP_DIR = "_temporary"
# One chunk per input file: a micro-batch file is parsed by one worker into one shard.
_WHOLE_FILE = 2**62


@dataclasses.dataclass(frozen=True, kw_only=True)
class FollowConfig:
    """What `follow` watches, where it writes, and when a file counts as complete."""

    inputs: tuple[str, ...]  # local globs of input files (TSV/CSV, .gz, Parquet)
    output: str  # the stream dataset directory
    reference: str  # a complete `hybridrec preprocess` output: its spec and statistics are used
    poll_interval: float = 0.5  # seconds between looks at the input globs
    settle_seconds: float = 0.5  # a file's size and mtime must be unchanged this long
    grow_timeout: float = 60.0  # seconds a file may keep changing before it is a dead letter
    marker_suffix: str = ""  # if set, NAME is complete once NAME<suffix> exists
    max_files_per_run: int = 16  # files in one bounded Beam run
    block_mb: float = 16.0  # MB of text parsed per batch
    compression: str = "zstd"  # Parquet codec of the shards
    snapshot_every: int = 50  # event logs: files between snapshots of the users' state

    def __post_init__(self):
        object.__setattr__(self, "inputs", tuple(str(path) for path in self.inputs))
        if not self.inputs:
            raise UserError("--input: give at least one glob to follow")
        if any("://" in path for path in (*self.inputs, self.output)):
            raise UserError("follow mode reads and writes local paths (see docs/online.md)")
        for name in ("poll_interval", "settle_seconds", "grow_timeout"):
            if getattr(self, name) < 0:
                raise UserError(f"{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.snapshot_every < 1:
            raise UserError(f"snapshot-every must be >= 1, got {self.snapshot_every}")
        if self.max_files_per_run < 1:
            raise UserError(f"max-files-per-run must be >= 1, got {self.max_files_per_run}")


def open_stream_dataset(output: str | Path, reference: str | Path) -> FeatureSpec:
    """Creates (or reopens) the stream dataset `output` with `reference`'s frozen statistics.

    Returns:
        The spec every file of the stream is parsed with.

    Raises:
        UserError: the reference is not a complete dataset, or `output` is a stream
            dataset of a different spec, or a batch dataset.
    """
    reference_meta = metadata.read_metadata(reference).raw
    out = Path(output)
    path = out / metadata.METADATA_FILE
    if path.exists():
        existing = json.loads(path.read_text())
        if "stream" not in existing:
            raise UserError(f"{out} holds a batch dataset, not a stream; pick another --output")
        if existing["spec"] != reference_meta["spec"]:
            raise UserError(
                f"{out} is a stream of another spec than --stats {reference}; pick another --output"
            )
        return spec_from_json(existing["spec"])
    out.mkdir(parents=True, exist_ok=True)
    frozen = {
        key: reference_meta[key]
        for key in ("format_version", "hash_scheme", "spec", "stats", "input_format")
        if key in reference_meta
    }
    frozen["splits"] = {"train": {"rows": 0, "files": []}, "eval": {"rows": 0, "files": []}}
    frozen["stream"] = {
        "manifest": manifest.MANIFEST_FILE,
        "reference": str(Path(reference).resolve()),
    }
    atomic_write_text(path, json.dumps(frozen, indent=1))
    (out / metadata.SUCCESS_FILE).touch()  # the header is complete; rows come by the manifest
    fsync_directory(out)
    return spec_from_json(frozen["spec"])


# ---- which files are complete --------------------------------------------------------------


@dataclasses.dataclass
class _Seen:
    size: int
    mtime_ns: int
    first_seen: float  # monotonic
    changed: float  # monotonic time of the last observed change


class FileWatcher:
    """Finds input files that are complete under the producer contract.

    Args:
        config: the globs, marker suffix and timings.
        done: input paths already in the manifest (never returned again).
    """

    def __init__(self, config: FollowConfig, done: set[str]):
        self.config = config
        self.done = set(done)
        self._seen: dict[str, _Seen] = {}

    def poll(self, now: float) -> tuple[list[str], list[tuple[str, str]]]:
        """(complete files in arrival order, [(file, reason)] of files that never completed)."""
        config, ready, overdue = self.config, [], []
        for path in self._matches():
            try:
                stat = os.stat(path)
            except FileNotFoundError:  # renamed away between the glob and the stat
                continue
            seen = self._seen.get(path)
            if seen is None:  # unchanged since its mtime, as far as anyone can tell
                age = max(0.0, time.time() - stat.st_mtime_ns / 1e9)
                seen = _Seen(stat.st_size, stat.st_mtime_ns, now, now - age)
                self._seen[path] = seen
            elif (stat.st_size, stat.st_mtime_ns) != (seen.size, seen.mtime_ns):
                seen.size, seen.mtime_ns, seen.changed = stat.st_size, stat.st_mtime_ns, now
            marked = not config.marker_suffix or os.path.exists(path + config.marker_suffix)
            if marked and now - seen.changed >= config.settle_seconds:
                ready.append((stat.st_mtime_ns, path))
            elif now - seen.first_seen > config.grow_timeout:
                what = (
                    f"no {config.marker_suffix} marker"
                    if not marked
                    else f"still growing (now {stat.st_size:,} bytes)"
                )
                overdue.append((path, f"incomplete: {what} after {config.grow_timeout:g}s"))
        return [path for _, path in sorted(ready)], overdue

    def taken(self, path: str) -> None:
        self.done.add(path)
        self._seen.pop(path, None)

    def _matches(self) -> list[str]:
        paths = set()
        for pattern in self.config.inputs:
            paths.update(glob.glob(pattern))
        suffix = self.config.marker_suffix
        return sorted(
            p
            for p in paths
            if p not in self.done and not (suffix and p.endswith(suffix)) and os.path.isfile(p)
        )


# ---- one bounded Beam run ----------------------------------------------------------------


class _ProcessFileFn(beam.DoFn):
    """(seq, path) -> a temporary shard + a result file; never raises for bad input."""

    def __init__(self, spec: FeatureSpec, temp_dir: str, block_bytes: int, compression: str):
        self.spec = spec
        self.temp_dir = temp_dir
        self.block_bytes = block_bytes
        self.compression = compression
        self.files = beam.metrics.Metrics.counter("follow", "files")

    def setup(self):
        self.parser = BlockParser(self.spec)

    def process(self, item: tuple[int, str]):
        seq, path = item
        directory = os.path.join(self.temp_dir, f"{seq:06d}")
        shutil.rmtree(directory, ignore_errors=True)  # a retried element starts clean
        os.makedirs(directory)
        result = process_file(path, self.spec, self.parser, directory, self.block_bytes, self.compression)  # fmt: skip
        atomic_write_text(os.path.join(directory, "result.json"), json.dumps(result))
        self.files.inc()
        yield seq


def process_file(
    path: str, spec: FeatureSpec, parser: BlockParser, directory: str, block_bytes: int, compression: str
) -> dict[str, Any]:  # fmt: skip
    """Parses one input file into `directory/train/chunk-00000-00000.parquet`.

    Returns:
        {"rows", "rejected", "rejected_by_reason"} or {"error": reason} when the file
        cannot be a shard (unreadable, empty, or no valid row).
    """
    try:
        chunks = _chunks.list_chunks([path], _WHOLE_FILE, spec=spec)
        (chunk,) = chunks  # one chunk per file
        split = _splits.SplitRule("position", 0.0, eval_start_line=2**62)  # every row trains
        stats, rejected = _chunks.process_chunk(
            chunk, spec=spec, parser=parser, first_line=0, global_first_line=0, split=split,
            temp_dir=directory, block_bytes=block_bytes, compression=compression,
        )  # fmt: skip
    except InputError as error:
        return {"error": error.plain}
    except UserError as error:
        return {"error": str(error)}
    except (OSError, EOFError, ValueError) as error:
        return {"error": f"{path}: unreadable: {error}"}
    reasons = dict(stats.rejected_by_reason)
    rows = stats.rows_by_split["train"]
    if rejected:
        with open(os.path.join(directory, "rejected.jsonl"), "w") as handle:
            handle.write("".join(f"{line}\n" for line in rejected))
    if stats.rows_read == 0:
        return {"error": f"{path}: empty file (no rows)"}
    if rows == 0:
        counts = ", ".join(f"{reason} {count}" for reason, count in sorted(reasons.items()))
        first = json.loads(rejected[0]) if rejected else {}
        return {
            "error": f"{path}: every row rejected ({counts}); first: line "
            f"{first.get('line', first.get('row'))}: {first.get('detail', '')} "
            "(a different schema than the reference?)"
        }
    return {"rows": rows, "rejected": len(rejected), "rejected_by_reason": reasons}


class ClickFiles:
    """The click-log side of `follow`: each file parsed into its shard by the Beam step."""

    kind = "clicks"
    folders = ("shards", "rejected", "dead_letter")  # what the stream's directory holds

    def __init__(self, out: Path, reference: str, *, block_bytes: int, compression: str):
        self.spec = open_stream_dataset(out, reference)
        self.block_bytes, self.compression = block_bytes, compression

    def dofn(self, temp_dir: str) -> beam.DoFn:
        return _ProcessFileFn(self.spec, temp_dir, self.block_bytes, self.compression)

    def recover(self, entries: list[manifest.ManifestEntry]) -> None:
        """Nothing kept across files."""

    def prepare(self, seq: int, temp: Path, result: dict) -> dict:
        return result  # the Beam step wrote the shard

    def committed(self) -> None:
        """Nothing kept across files."""

    def close(self) -> None:
        """Nothing kept across files."""


def _files(config: FollowConfig):
    """The handler of the reference's kind: click-log shards, or event histories."""
    out, block_bytes = Path(config.output), int(config.block_mb * 2**20)
    if metadata.read_dataset(config.reference).kind == "events":
        return EventFiles(out, config.reference, block_bytes=block_bytes, compression=config.compression, snapshot_every=config.snapshot_every)  # fmt: skip
    return ClickFiles(out, config.reference, block_bytes=block_bytes, compression=config.compression)  # fmt: skip


def _run_beam(work: list[tuple[int, str]], dofn: beam.DoFn, beam_args) -> None:
    options = PipelineOptions(
        list(beam_args)
        or ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]
    )
    with make_pipeline(options) as pipeline:
        _ = pipeline | "ListNewFiles" >> beam.Create(work) | "ProcessFiles" >> beam.ParDo(dofn)


# ---- commits -------------------------------------------------------------------------------


def _commit(out: Path, seq: int, source: str, temp: Path, result: dict) -> manifest.ManifestEntry:
    """Moves one file's outputs into place, then appends its manifest line (the commit)."""
    stat = os.stat(source) if os.path.exists(source) else None
    entry: dict[str, Any] = {
        "seq": seq,
        "source": source,
        "size": stat.st_size if stat else None,
        "mtime_ns": stat.st_mtime_ns if stat else None,
        "committed_unix": time.time(),
    }
    rejected = temp / "rejected.jsonl"
    if rejected.exists():
        target = out / manifest.REJECTED_DIR / f"rejected-{seq:06d}.jsonl"
        target.parent.mkdir(exist_ok=True)
        os.replace(rejected, target)
        entry["rejected_file"] = str(target.relative_to(out))
    if "error" in result:
        dead = out / manifest.DEAD_LETTER_DIR
        dead.mkdir(exist_ok=True)
        copy = dead / f"{seq:06d}-{os.path.basename(source)}"
        if os.path.exists(source):
            shutil.copyfile(source, copy)
        atomic_write_text(copy.with_name(copy.name + ".reason.txt"), result["error"] + "\n")
        entry.update(kind="dead_letter", reason=result["error"], copy=str(copy.relative_to(out)))
    else:
        for source_path, target in result.get("moves", {}).items():  # fsynced, renamed
            (out / target).parent.mkdir(exist_ok=True)
            with open(source_path, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(source_path, out / target)
            fsync_directory((out / target).parent)
        name = manifest.shard_name(seq)
        (out / manifest.SHARDS_DIR).mkdir(exist_ok=True)
        shard = temp / "train" / "chunk-00000-00000.parquet"
        with open(shard, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(shard, out / name)
        fsync_directory(out / manifest.SHARDS_DIR)
        entry.update(kind="shard", shard=name, rows=result["rows"],
                     rejected=result["rejected"], rejected_by_reason=result["rejected_by_reason"])  # fmt: skip
        entry.update(result.get("fields", {}))
    manifest.append(out, entry)
    shutil.rmtree(temp, ignore_errors=True)
    return manifest.entry_from_dict(entry)


def _recover(out: Path) -> list[manifest.ManifestEntry]:
    """After a kill: truncate a torn manifest line, drop uncommitted leftovers."""
    committed = manifest.repair(out)
    shutil.rmtree(out / TEMP_DIR, ignore_errors=True)
    for folder in (
        manifest.SHARDS_DIR,
        manifest.DEAD_LETTER_DIR,
        manifest.REJECTED_DIR,
        manifest.ITEMS_DIR,
    ):
        for leftover in (out / folder).glob("*"):
            # part-NNNNNN.parquet, rejected-NNNNNN.jsonl, items-NNNNNN.parquet, NNNNNN-NAME[.reason.txt]
            stem = leftover.name.split(".")[0]
            digits = stem.split("-")[0] if folder == manifest.DEAD_LETTER_DIR else stem[-6:]
            if digits.isdigit() and int(digits) >= committed:
                leftover.unlink()
    return manifest.read_manifest(out)


@dataclasses.dataclass
class FollowSummary:
    """What one `follow` call committed."""

    files: int = 0  # files that became shards
    rows: int = 0  # rows in those shards
    rejected_rows: int = 0  # rows rejected inside accepted files
    dead_letters: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (file, reason)
    seconds: float = 0.0
    kind: str = "clicks"  # or "events": an event log's stream
    events: int = 0  # event logs: new events in the shards
    targets: int = 0  # event logs: of them, the next-item targets (a new user's first is not)
    folders: tuple[str, ...] = ("shards", "rejected", "dead_letter")  # what the output holds

    def line(self) -> str:
        """One line of what was followed: files, rows, rejects (and an event log's events)."""
        line = (
            f"followed for {self.seconds:.1f}s: {self.files} files -> {self.rows:,} rows "
            f"({self.rows / max(self.seconds, 1e-9):,.0f} rows/s), {self.rejected_rows:,} "
            f"rows rejected, {len(self.dead_letters)} dead letters"
        )
        if self.events:
            line += f"; {self.events:,} events, {self.targets:,} new targets for their users"
        return line


def follow(
    config: FollowConfig,
    *,
    stop: threading.Event | None = None,
    max_idle: float = 0.0,
    beam_args: Sequence[str] = (),
    on_commit: Callable[[manifest.ManifestEntry], None] | None = None,
    quiet: bool = False,
) -> FollowSummary:
    """Turns complete input files into committed shards until `stop` is set.

    Args:
        config: globs, output, reference and timings.
        stop: set it to end after the current run (SIGTERM in the command); None: never.
        max_idle: also end after this many seconds with no new file (0: never).
        beam_args: Beam pipeline options for each bounded run (default: the in-memory
            DirectRunner, which starts in ~0.1 s).
        on_commit: called with each committed manifest entry.
        quiet: no per-file lines on stderr.
    """
    stop = stop or threading.Event()
    out = Path(config.output)
    files = _files(config)
    entries = _recover(out)
    files.recover(entries)
    watcher = FileWatcher(config, {entry.source for entry in entries})
    seq, summary = len(entries), FollowSummary(kind=files.kind, folders=files.folders)
    started = last_new = time.monotonic()
    temp_dir = out / TEMP_DIR
    while not stop.is_set():
        now = time.monotonic()
        ready, overdue = watcher.poll(now)
        work = [(seq + i, path) for i, path in enumerate(ready[: config.max_files_per_run])]
        if work:
            _run_beam(work, files.dofn(str(temp_dir)), beam_args)
        results = [(s, p, _read_result(temp_dir / f"{s:06d}")) for s, p in work]
        results += [(seq + len(work) + i, p, {"error": reason}) for i, (p, reason) in enumerate(overdue)]  # fmt: skip
        for number, path, result in results:
            temp = temp_dir / f"{number:06d}"
            result = files.prepare(number, temp, result)
            entry = _commit(out, number, path, temp, result)
            files.committed()
            watcher.taken(path)
            _count(summary, entry, result, quiet)
            if on_commit:
                on_commit(entry)
        seq += len(results)
        if results:
            last_new = time.monotonic()
            continue
        if max_idle and time.monotonic() - last_new >= max_idle:
            break
        stop.wait(config.poll_interval)
    files.close()
    summary.seconds = time.monotonic() - started
    return summary


def _read_result(directory: Path) -> dict:
    try:
        return json.loads((directory / "result.json").read_text())
    except (OSError, ValueError) as error:  # the runner lost the element: not a data problem
        raise RuntimeError(f"{directory}: the Beam run left no result ({error})") from None


def _count(summary: FollowSummary, entry: manifest.ManifestEntry, result: dict, quiet: bool):
    if entry.is_shard:
        summary.files += 1
        summary.rows += entry.rows
        summary.rejected_rows += result.get("rejected", 0)
        line = f"[follow] {entry.shard} <- {entry.source}: {entry.rows:,} rows"
        if "events" in entry.raw:
            summary.events += entry.raw["events"]
            summary.targets += entry.raw["targets"]
            line += f" ({entry.raw['events']:,} events of {entry.raw['users']:,} users, {entry.raw['new_users']:,} new)"  # fmt: skip
        if result.get("rejected"):
            line += f", {result['rejected']:,} rejected ({entry.raw.get('rejected_file')})"
    else:
        summary.dead_letters.append((entry.source, entry.reason))
        line = f"[follow] dead letter {entry.raw['copy']}: {entry.reason}"
    if not quiet:
        print(line, file=sys.stderr, flush=True)
