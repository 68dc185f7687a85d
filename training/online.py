"""Follow-mode training (`hybridrec train --follow DATA`): keep training as shards arrive.

    manifest.jsonl (pipeline.manifest) ──► StreamReader: batches from the position on
      ──► bursts of HybridLoop steps (the same overlap as `HybridTrainer`) over the
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

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from hybridrec.common.errors import UserError
from hybridrec.model import check_finite_losses, make_train_step
from hybridrec.training.checkpoint import RunCheckpoints
from hybridrec.training.input import Columns
from hybridrec.training.job import prepare
from hybridrec.training.run_log import RunLog
from hybridrec.training.stream import StreamPosition, StreamReader, batch_sizes

PUBLISHED_FILE = "published.jsonl"  # one line per published export: step, version, position


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
            Columns(
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
        step = self.checkpoints.begin(self.config, resume=self.resume, chief=True)
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
        """Trains one batch per size through a HybridLoop; stops early on `stop`."""
        started = time.monotonic()
        loop = self.job.hybrid_loop(
            self.reader.batches(self.position, sizes),
            state=self.state,
            train_step=self.train_step,
            store=self.store,
            first_step=self.step + 1,
        )
        rows, loss = 0, None
        with loop:
            for index in range(len(sizes)):
                stopping = stop.is_set()
                save_now = self._due()
                last = stopping or index == len(sizes) - 1
                result = loop.progress(quiesce=last or save_now)
                if result is None:
                    raise UserError(f"{self.reader.root}: the stream ended inside a planned burst")
                self.step, self.position, self.state = result.step, result.position, loop.state
                for shard, count in result.position.pieces:
                    by_shard = self.counters["rows_by_shard"]
                    by_shard[str(shard)] = by_shard.get(str(shard), 0) + count
                    rows += count
                self.counters["rows"] += sizes[index]
                loss = result.metrics["loss"]
                if save_now and not last:
                    self._maybe_save_and_publish()
                    loop.resume()
                if last:
                    break
        seconds = time.monotonic() - started
        self.counters["seconds"] += seconds
        loss = float(jax.device_get(loss))
        check_finite_losses([loss], self.step)
        self.log.write(
            "train", self.step, loss=loss, rows=rows, rows_per_s=rows / max(seconds, 1e-9),
            rows_trained=self.counters["rows"], shard=self.position.shard,
            shards_seen=len(self.reader.shards), staleness_max=int(loop.gate.max_staleness),
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
