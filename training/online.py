"""Follow-mode training (`hybridrec train --follow DATA`): keep training as shards arrive.

    manifest.jsonl (pipeline.manifest) ──► StreamReader: batches from the position on
      ──► bursts of HybridPipeline steps (the same overlap as `HybridTrainer`) over the
          rows committed so far; idle (a blocking wait, no spinning) when there are none
      ──► a checkpoint every `checkpoint_every` seconds, a published export every
          `publish_every` seconds, a final checkpoint and export on `stop` (SIGTERM)

Exactly once: the stream position (next shard, rows of it trained) is saved in the
checkpoint with the dense state and embeddings of the same step, so after a kill at any
moment the run resumes from a model that has trained exactly the rows before the
position. The checkpoint also carries rows trained per shard, counted batch by batch as
the steps run, so that "every row once" can be checked against the manifest.

Batches have the configured size while rows keep coming; once the stream has been
idle for `flush_after` seconds, the remaining rows are trained in batches of
decreasing powers of two (each a multiple of the device count, each shape compiled
once), so a file's last rows do not wait for the next file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hybridrec.common import config as config_lib
from hybridrec.common.errors import UserError
from hybridrec.embedding_store import checkpoint as store_checkpoint
from hybridrec.model import NonFiniteLossError, make_train_step
from hybridrec.pipeline import ManifestEntry, read_shards
from hybridrec.training.checkpoint import RunCheckpoints
from hybridrec.training.hybrid import HybridPipeline
from hybridrec.training.input import Batch, _Columns, _concat, _rows_from_arrow, _slice
from hybridrec.training.job import CONFIG_FILE, prepare
from hybridrec.training.run_log import RunLog

PUBLISHED_FILE = "published.jsonl"  # one line per published export: step, version, position


@dataclasses.dataclass(frozen=True)
class StreamPosition:
    """The next row to train: row `offset` of shard `shard` (manifest shard order)."""

    shard: int = 0  # index of the next shard among the manifest's shard lines
    offset: int = 0  # rows of that shard already trained
    batches: int = 0  # batches trained since the start of the run
    pieces: tuple[tuple[int, int], ...] = ()  # (shard, rows) of the batch ending here

    def to_dict(self) -> dict[str, int]:
        return {"shard": self.shard, "offset": self.offset, "batches": self.batches}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StreamPosition:
        return cls(int(data["shard"]), int(data["offset"]), int(data["batches"]))


def batch_sizes(rows: int, batch_size: int, divisor: int, *, flush: bool) -> list[int]:
    """Batch sizes to train `rows` available rows with (static shapes, few of them).

    Full batches of `batch_size`; with `flush`, then the rest as decreasing powers of two
    times `divisor` (fewer than `divisor` rows stay for later).
    """
    sizes = [batch_size] * (rows // batch_size)
    if flush:
        units = (rows - len(sizes) * batch_size) // divisor
        for bit in reversed(range(units.bit_length())):
            if units >> bit & 1:
                sizes.append(divisor << bit)
    return sizes


class StreamReader:
    """Batches of a stream dataset's committed shards, from a position.

    Args:
        data_dir: the stream dataset (`hybridrec preprocess --follow` output).
        columns: the label, dense and id columns to read.
    """

    def __init__(self, data_dir: str | Path, columns: _Columns):
        self.root = Path(data_dir)
        self.columns = columns
        self.shards: list[ManifestEntry] = []
        self._cached: tuple[int, dict] | None = None

    def refresh(self) -> int:
        """Reads newly committed shard lines; returns how many shards are known."""
        self.shards += read_shards(self.root, start=len(self.shards))
        return len(self.shards)

    def available(self, position: StreamPosition) -> int:
        """Rows committed and not yet trained from `position` on."""
        rows = sum(entry.rows for entry in self.shards[position.shard :])
        return rows - position.offset

    def batches(self, position: StreamPosition, sizes: list[int]) -> Iterator[Batch]:
        """Yields one batch per size, from `position` (the rows must be available)."""
        shard, offset, produced = position.shard, position.offset, position.batches
        for size in sizes:
            parts, pieces = [], []
            while size:
                rows = self._shard_rows(shard)
                take = min(size, len(rows["label"]) - offset)
                parts.append(_slice(rows, offset, offset + take))
                pieces.append((shard, take))
                offset += take
                size -= take
                if offset == len(rows["label"]):
                    shard, offset = shard + 1, 0
            produced += 1
            merged = _concat(parts)
            yield Batch(
                dense=np.ascontiguousarray(merged["dense"], np.float32),
                labels=np.ascontiguousarray(merged["label"], np.float32),
                ids=dict(merged["ids"]),
                valid=np.ones(len(merged["label"]), bool),
                position=StreamPosition(shard, offset, produced, tuple(pieces)),
            )

    def _shard_rows(self, index: int) -> dict:
        if self._cached is None or self._cached[0] != index:
            entry = self.shards[index]
            path = self.root / entry.shard
            try:
                table = pq.read_table(path, columns=self.columns.all)
            except (OSError, pa.ArrowInvalid) as error:
                raise UserError(f"{path}: cannot read shard: {error}") from None
            if table.num_rows != entry.rows:
                raise UserError(
                    f"{path}: {table.num_rows} rows, the manifest line {entry.seq} says {entry.rows}"
                )
            self._cached = (index, _rows_from_arrow(table, self.columns, str(path)))
        return self._cached[1]


def _append_line(path: Path, line: str) -> None:
    """Appends one line in one write, after dropping a torn last line (a killed writer)."""
    if path.exists():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(path, "r+b") as handle:
                handle.truncate(data.rfind(b"\n") + 1)
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, (line + "\n").encode())
    finally:
        os.close(descriptor)


def prune_embedding_checkpoints(url: str, keep: int) -> None:
    """Removes embedding snapshots that none of the newest `keep` committed ones reads.

    A run that never stops checkpoints without end; each snapshot's manifest names the
    chain of snapshot groups it is rebuilt from (a full one every `MAX_CHAIN`), so
    disk use stays within about two chains.
    """
    steps = store_checkpoint.committed_steps(url)
    if keep < 1 or len(steps) <= keep:
        return
    kept = steps[-keep:]
    needed = set()
    for step in kept:
        for table in store_checkpoint.read_manifest(url, step)["tables"].values():
            needed.update(group["step"] for group in table["chain"])
    root = Path(url)
    for step in steps[:-keep]:  # manifests first: they are what makes a snapshot visible
        (root / store_checkpoint.manifest_key(step)).unlink(missing_ok=True)
    for directory in root.glob("step-*"):
        number = directory.name.removeprefix("step-")
        if number.isdigit() and int(number) < kept[0] and int(number) not in needed:
            shutil.rmtree(directory, ignore_errors=True)


class OnlineTrainer:
    """Trains a run directory from a stream dataset until stopped.

    Args:
        config: the run's configuration (`data.path` is the stream dataset).
        run_dir: metrics, checkpoints and `published.jsonl` go here.
        resume: continue from the newest complete checkpoint in run_dir.
        checkpoint_every: seconds between checkpoints (while there is new training).
        publish_every: seconds between published exports (0: only at the end; needs `publish`).
        publish: `publish(step) -> {"version": ...}`: writes an export of checkpoint `step`
            (the command passes `serving.export_run`).
        flush_after: seconds without new rows before a partial batch is trained.
        poll_interval: seconds between looks at the manifest when idle.
        max_idle: also stop after this many seconds without new rows (0: never).
        quiet: no progress lines.
        servers: the remote shard servers as the command resolved them (see `prepare`).
    """

    def __init__(
        self,
        config: Any,
        run_dir: str | Path,
        *,
        resume: bool = False,
        checkpoint_every: float = 30.0,
        publish_every: float = 0.0,
        publish: Callable[[int], dict[str, Any]] | None = None,
        flush_after: float = 1.0,
        poll_interval: float = 0.5,
        max_idle: float = 0.0,
        quiet: bool = False,
        servers: Any = None,
    ):
        self.run_dir = Path(run_dir)
        self.job = prepare(config, servers=servers)
        self.config = self.job.config
        if self.job.process_count > 1:
            raise UserError("train --follow runs in one process (use remote embedding servers to scale the store)")  # fmt: skip
        if "stream" not in self.job.metadata.raw:
            raise UserError(f"{config.data.path}: not a stream dataset (write one with `hybridrec preprocess --follow`)")  # fmt: skip
        self.resume = resume
        self.checkpoint_every = checkpoint_every
        self.publish_every = publish_every
        self.publish = publish
        self.flush_after = flush_after
        self.poll_interval = poll_interval
        self.max_idle = max_idle
        self.quiet = quiet
        self.checkpoints = RunCheckpoints(self.run_dir, keep=self.config.checkpoint.keep)
        metadata = self.job.metadata
        self.reader = StreamReader(
            metadata.root,
            _Columns(
                metadata.label_column,
                tuple(metadata.dense_columns),
                tuple(f.name for f in metadata.categorical if not f.multi_valued),
                tuple(f.name for f in metadata.categorical if f.multi_valued),
            ),
        )

    def run(self, stop: threading.Event | None = None) -> dict[str, Any]:
        """Trains until `stop` is set (or `max_idle`); returns the summary."""
        stop = stop or threading.Event()
        job = self.job
        self.step, self.state, self.position, self.counters = self._restore()
        self.store = job.open_store(self.checkpoints, self.step or None)
        self.train_step = make_train_step(job.mesh)
        self.log = RunLog(
            self.run_dir, tensorboard=self.config.log.tensorboard, resume_step=self.step or None
        )
        self.saved_step, self.published_step = self.step, None
        self.last_save = self.last_publish = last_new = started = time.monotonic()
        known = 0
        try:
            if self.reader.refresh() < self.position.shard + (self.position.offset > 0):
                raise UserError(
                    f"{self.run_dir}: the checkpoint is at shard {self.position.shard} of "
                    f"{self.reader.root}, which has {len(self.reader.shards)} committed shards; "
                    "a run follows one stream (start a new --run-dir for another)"
                )
            while True:
                if self.reader.refresh() > known:  # new shards: flush partial batches later
                    known, last_new = len(self.reader.shards), time.monotonic()
                available = self.reader.available(self.position)
                idle = time.monotonic() - last_new
                sizes = batch_sizes(
                    available,
                    self.config.data.batch_size,
                    job.mesh.devices.size,
                    flush=idle >= self.flush_after,
                )
                if sizes and not stop.is_set():
                    self._burst(sizes, stop)
                    continue
                if stop.is_set() or (self.max_idle and idle >= self.max_idle):
                    break
                self._maybe_save_and_publish()
                stop.wait(self.poll_interval)
            self._save()
            if self.publish:
                self._publish()
        finally:
            self.log.close()
            self.store.close()
            self.checkpoints.close()
        return {
            "steps": self.step,
            "rows_trained": self.counters["rows"],
            "rows_by_shard": dict(self.counters["rows_by_shard"]),
            "position": self.position.to_dict(),
            "shards_seen": len(self.reader.shards),
            "seconds": round(time.monotonic() - started, 3),
            "checkpoint_step": self.checkpoints.latest_step(),
            "run_dir": str(self.run_dir),
        }

    def _restore(self) -> tuple[int, Any, StreamPosition, dict[str, Any]]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        step = self.checkpoints.latest_step()
        if step is not None and not self.resume:
            raise UserError(f"{self.run_dir} already holds a checkpoint (step {step}); pass --resume to continue it")  # fmt: skip
        (self.run_dir / CONFIG_FILE).write_text(
            json.dumps(config_lib.to_dict(self.config), indent=2) + "\n"
        )
        self.checkpoints.discard_after(step or 0, chief=True)
        state = self.job.new_state()
        counters: dict[str, Any] = {"rows": 0, "rows_by_shard": {}, "seconds": 0.0}
        if step is None:
            return 0, state, StreamPosition(), counters
        state = self.checkpoints.restore_dense(step, state)
        saved = self.checkpoints.read_position(step, 0)
        if "stream" not in saved:
            raise UserError(f"{self.run_dir}: checkpoint {step} is of a batch run, not a --follow run")  # fmt: skip
        counters = {"rows": saved["rows"], "rows_by_shard": saved["rows_by_shard"], "seconds": saved["seconds"]}  # fmt: skip
        return step, state, StreamPosition.from_dict(saved["stream"]), counters

    def _burst(self, sizes: list[int], stop: threading.Event) -> None:
        """Trains one batch per size through a HybridPipeline; stops early on `stop`."""
        config = self.config
        started = time.monotonic()
        pipeline = HybridPipeline(
            self.reader.batches(self.position, sizes),
            state=self.state,
            train_step=self.train_step,
            store=self.store,
            mesh=self.job.mesh,
            feature_tables=self.job.tables.feature_tables,
            pooling=config.embedding.pooling,
            staleness=config.hybrid.staleness,
            lookahead=config.hybrid.lookahead,
            steps_ahead=config.hybrid.steps_ahead,
            first_step=self.step + 1,
            prefetch=config.data.prefetch,
            nice=config.hybrid.background_nice if config.hybrid.staleness else 0,
        )
        rows, loss = 0, None
        with pipeline:
            for index in range(len(sizes)):
                stopping = stop.is_set()
                save_now = self._due()
                last = stopping or index == len(sizes) - 1
                result = pipeline.progress(quiesce=last or save_now)
                if result is None:
                    raise UserError(f"{self.reader.root}: the stream ended inside a planned burst")
                self.step, self.position, self.state = result.step, result.position, pipeline.state
                for shard, count in result.position.pieces:
                    by_shard = self.counters["rows_by_shard"]
                    by_shard[str(shard)] = by_shard.get(str(shard), 0) + count
                    rows += count
                self.counters["rows"] += sizes[index]
                loss = result.metrics["loss"]
                if save_now and not last:
                    self._maybe_save_and_publish()
                    pipeline.resume()
                if last:
                    break
        seconds = time.monotonic() - started
        self.counters["seconds"] += seconds
        loss = float(jax.device_get(loss))
        if not np.isfinite(loss):
            raise NonFiniteLossError(
                f"loss is {loss} at step {self.step}; lower the learning rates or check the "
                "stream's input features (the last checkpoint is intact: --resume after a fix)"
            )
        self.log.write(
            "train", self.step, loss=loss, rows=rows, rows_per_s=rows / max(seconds, 1e-9),
            rows_trained=self.counters["rows"], shard=self.position.shard,
            shards_seen=len(self.reader.shards), staleness_max=int(pipeline.gate.max_staleness),
        )  # fmt: skip
        if not self.quiet:
            print(
                f"[train --follow] step {self.step}: +{rows:,} rows in {seconds:.1f}s "
                f"({rows / max(seconds, 1e-9):,.0f} rows/s), loss {loss:.4f}, "
                f"{self.counters['rows']:,} rows trained, shard {self.position.shard}/"
                f"{len(self.reader.shards)}",
                file=sys.stderr,
                flush=True,
            )
        self._maybe_save_and_publish()

    def _due(self) -> bool:
        now = time.monotonic()
        return (self.checkpoint_every and now - self.last_save >= self.checkpoint_every) or bool(
            self.publish and self.publish_every and now - self.last_publish >= self.publish_every
        )

    def _maybe_save_and_publish(self) -> None:
        """Saves and publishes what is due (the store holds exactly the trained steps)."""
        now = time.monotonic()
        if self.checkpoint_every and now - self.last_save >= self.checkpoint_every:
            self._save()
        if self.publish and self.publish_every and now - self.last_publish >= self.publish_every:
            self._publish()

    def _save(self) -> None:
        self.last_save = time.monotonic()
        if self.step == self.saved_step:
            return
        self.checkpoints.save_dense(self.step, self.state)
        self.checkpoints.save_position(
            self.step,
            0,
            {"stream": self.position.to_dict(), **self.counters},
        )
        self.store.checkpoint(self.checkpoints.embeddings_url, self.step)
        self.checkpoints.commit(self.step)
        self.saved_step = self.step
        prune_embedding_checkpoints(self.checkpoints.embeddings_url, self.checkpoints.keep)

    def _publish(self) -> None:
        self.last_publish = time.monotonic()
        if self.step in (0, self.published_step):
            return
        self._save()
        started = time.time()
        result = self.publish(self.step)
        self.published_step = self.step
        record = {
            "step": self.step,
            "version": result.get("version"),
            "kind": result.get("kind", "full"),
            "export_bytes": result.get("total_bytes"),
            "rows_trained": self.counters["rows"],
            "position": self.position.to_dict(),
            "shards_complete": self.position.shard,
            "published_unix": time.time(),
            "seconds": round(time.time() - started, 3),
        }
        _append_line(self.run_dir / PUBLISHED_FILE, json.dumps(record))
        if not self.quiet:
            print(
                f"[train --follow] published version {record['version']} ({record['kind']}, "
                f"{(record['export_bytes'] or 0) / 2**20:.1f} MiB, step {self.step}, "
                f"{record['shards_complete']} shards complete) in {record['seconds']:.1f}s",
                file=sys.stderr,
                flush=True,
            )
