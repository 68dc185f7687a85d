"""The hybrid trainer behind `hybridrec train`: one run directory, start (or resume) to end.

A step, as in PERSIA (the overlap lives in `training/hybrid.py`):

    batch t ──► store.lookup_features (issued ahead, async) ──► devices
            ──► train_step (jitted, synchronous over the mesh)
            ──► embedding gradients ──► store.apply_pooled_gradients (async)

`fit` reads top to bottom: set up, restore, then the loop, where logging, checkpoints
and evaluation are each one schedule line.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from hybridrec.common.errors import UserError
from hybridrec.common.progress import Progress
from hybridrec.model import check_finite_losses, make_eval_step, make_train_step
from hybridrec.training.checkpoint import RunCheckpoints
from hybridrec.training.evaluate import evaluate
from hybridrec.training.hybrid import HybridLoop, StepResult
from hybridrec.training.input import DataPosition
from hybridrec.training.job import Job, prepare
from hybridrec.training.run_log import RunLog

SUMMARY_FILE = "summary.json"


def is_due(step: int, every: int, last: int) -> bool:
    """True at every `every`-th step (0 = never) and at the last step."""
    return step == last or (every > 0 and step % every == 0)


class HybridTrainer:
    """Trains one run directory with the hybrid loop.

    Args:
        config: the run's configuration.
        run_dir: where metrics, checkpoints, TensorBoard files and the summary go.
        resume: continue from the newest complete checkpoint in run_dir.
        distributed: coordinator / num_processes / process_id for multi-process jobs.
        quiet: no progress lines (tests, benchmarks).
        store: an embedding store to train instead of the one the config describes (its
            tables must be `plan_tables` of the config); the caller keeps ownership.
        servers: the remote shard servers as the command resolved them (see `prepare`).
    """

    def __init__(
        self,
        config: Any,
        run_dir: str | Path,
        *,
        resume: bool = False,
        distributed: dict[str, Any] | None = None,
        quiet: bool = False,
        store: Any = None,
        servers: Any = None,
    ):
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.quiet = quiet
        self.job: Job = prepare(config, distributed=distributed, servers=servers)
        self.config = self.job.config
        self.checkpoints = RunCheckpoints(self.run_dir, keep=config.checkpoint.keep)
        self._given_store = store
        self.store = None
        self.loop: HybridLoop | None = None

    @property
    def is_chief(self) -> bool:
        return self.job.is_chief

    def fit(self) -> dict[str, Any]:
        """Runs training to the end; returns the summary (also written to summary.json)."""
        config, job = self.config, self.job
        resume_step = self._prepare_run_dir()
        state = job.new_state()
        position, counters = DataPosition(), {"samples": 0, "seconds": 0.0}
        if resume_step is not None:
            state = self.checkpoints.restore_dense(resume_step, state)
            saved = self.checkpoints.read_position(resume_step, job.process_index)
            position = DataPosition.from_dict(saved["position"])
            counters = {"samples": saved["samples"], "seconds": saved["seconds"]}
        if self._given_store is not None and resume_step is not None:
            raise UserError("a given embedding store cannot resume a run: let the trainer open it")
        self.store = self._given_store or job.open_store(self.checkpoints, resume_step)

        reader, rows = job.reader(
            config.data.train_split, batch_size=config.data.batch_size, train=True
        )
        first_step = (resume_step or 0) + 1
        last_step = config.data.max_steps or config.data.epochs * reader.batches_per_epoch
        eval_step = make_eval_step(job.mesh)
        log = RunLog(
            self.run_dir,
            enabled=self.is_chief,
            tensorboard=config.log.tensorboard,
            resume_step=resume_step,
        )
        progress = None
        if self.is_chief and not self.quiet:
            progress = Progress(
                "train",
                total=last_step * config.data.batch_size,
                unit="samples",
                interval=config.log.progress_interval,
            )
            progress.count = counters["samples"]
        self.loop = job.hybrid_loop(
            reader.batches(num_batches=last_step, position=position),
            state=state,
            train_step=make_train_step(job.mesh),
            store=self.store,
            first_step=first_step,
            rows=rows,
        )
        meter = _IntervalMeter(samples_done=counters["samples"])
        store_meter = _StoreMeter(self.store)
        eval_results: dict[str, float] = {}
        progress_fields: dict[str, float] = {}
        try:
            with self.loop as loop:
                for step in range(first_step, last_step + 1):
                    save_now = is_due(step, config.checkpoint.every_steps, last_step)
                    eval_now = is_due(step, config.eval.every_steps, last_step)
                    result = loop.progress(quiesce=save_now or eval_now)
                    if result is None:
                        raise UserError(f"the input ended before step {step} of {last_step}")
                    meter.add(result, config.data.batch_size)
                    counters["samples"] += config.data.batch_size
                    if progress:
                        progress.update(config.data.batch_size, **progress_fields)
                    if is_due(step, config.log.every_steps, last_step):
                        final = step == last_step
                        record = meter.flush(step, loop.timings(), wait=final)
                        counters["seconds"] += record.pop("seconds")
                        progress_fields = {k: record[k] for k in ("loss", "staleness_mean")}
                        held = store_meter.read(wait=final)
                        log.write(
                            "train",
                            step,
                            samples=counters["samples"],
                            store_bytes_held=held.get("bytes_held"),
                            store_bytes_at_capacity=held.get("bytes_at_capacity"),
                            **record,
                        )
                    with meter.paused():  # saving and evaluating are not training time
                        if save_now:
                            self._save(step, result.position, counters)
                        if eval_now:
                            eval_results = evaluate(
                                job,
                                loop.state,
                                self.store,
                                eval_step,
                                max_batches=0 if step == last_step else config.eval.max_batches,
                                progress_name="evaluate"
                                if step == last_step and progress
                                else None,
                            )
                            log.write("eval", step, **eval_results)
                    if save_now or eval_now:
                        loop.resume()
                loop.drain()
        finally:
            log.close()
        if progress:
            progress.close()
        summary = self._summary(last_step, counters, eval_results, meter.last_loss)
        self._write_summary(summary)
        if self._given_store is None:
            self.store.close()
        self.checkpoints.close()
        return summary

    def _prepare_run_dir(self) -> int | None:
        """The step to resume from (None = fresh start); see `RunCheckpoints.begin`."""
        step = self.checkpoints.begin(self.config, resume=self.resume, chief=self.is_chief)
        self.job.barrier("discarded-partial-checkpoints")
        return step

    def _save(self, step: int, position: DataPosition, counters: dict[str, Any]) -> None:
        """Dense state, data position and embeddings at `step`, then the commit marker.

        The loop is quiesced: every update up to `step` is applied, no later lookup
        has reached the store.
        """
        job = self.job
        self.checkpoints.save_dense(step, self.loop.state)
        self.checkpoints.save_position(
            step, job.process_index, {"position": position.to_dict(), **counters}
        )
        job.barrier(f"checkpoint-parts-{step}")
        if job.is_chief:  # replicas are identical; remote shards are shared
            self.store.checkpoint(
                self.checkpoints.embeddings_url, step, precision=self.config.checkpoint.precision
            )
        job.barrier(f"checkpoint-embeddings-{step}")
        if job.is_chief:
            self.checkpoints.commit(step)

    def _summary(self, steps, counters, eval_results, final_loss) -> dict[str, Any]:
        seconds = counters["seconds"]
        gate = self.loop.gate
        return {
            "steps": int(steps),
            "samples": int(counters["samples"]),
            "train_seconds": round(seconds, 3),
            "samples_per_s": counters["samples"] / seconds if seconds else None,
            "final_loss": final_loss,
            "eval": eval_results,
            "staleness_bound": self.config.hybrid.staleness,
            "staleness_max": int(gate.max_staleness),
            "staleness_histogram": gate.histogram.tolist(),
            # totals over all tables (rows, bytes, admissions, evictions, cold-tier traffic)
            "embedding_store": {
                key: value for key, value in self.store.stats().items() if key != "tables"
            },
            "processes": self.job.process_count,
            "devices": int(self.job.mesh.devices.size),
            "run_dir": str(self.run_dir),
            "checkpoint_step": self.checkpoints.latest_step(),
            "metrics_file": str(self.run_dir / "metrics.jsonl"),
            "tensorboard_dir": str(self.run_dir / "tensorboard"),
        }

    def _write_summary(self, summary: dict[str, Any]) -> None:
        text = json.dumps(summary, indent=2) + "\n"
        if self.is_chief:
            (self.run_dir / SUMMARY_FILE).write_text(text)
        if self.job.process_count > 1:  # each process's own view, to compare across processes
            own = self.run_dir / "processes" / f"summary_{self.job.process_index}.json"
            own.parent.mkdir(exist_ok=True)
            own.write_text(text)


class _StoreMeter:
    """The store's counters for the log without waiting for the shards: each read asks
    for fresh counters and returns the latest answer at hand (the previous request's,
    at most one log interval old), or waits for the fresh ones when `wait`."""

    def __init__(self, store: Any):
        self._store = store
        self._pending = store.stats_async()
        self._latest: dict[str, Any] = {}

    def read(self, *, wait: bool = False) -> dict[str, Any]:
        if wait or not self._latest or self._pending.done():
            self._latest = self._pending.result()
        if self._pending.done():
            self._pending = self._store.stats_async()
        return self._latest


class _IntervalMeter:
    """Loss, throughput and staleness over one logging interval (losses stay on the
    devices until the interval ends, so logging never stalls a step: a flush takes the
    losses of the steps already done and leaves the rest to the next interval)."""

    def __init__(self, samples_done: int = 0):
        self.last_loss = float("nan")
        self.samples_done = samples_done  # samples of the steps whose loss has been fetched
        self._losses: list[tuple[jax.Array, int]] = []  # (loss, samples) of steps not fetched
        self._start_interval()

    def _start_interval(self) -> None:
        self._staleness: list[int] = []
        self._samples = 0
        self._start = time.perf_counter()
        self._paused_seconds = 0.0

    def add(self, result: StepResult, samples: int) -> None:
        self._losses.append((result.metrics["loss"], samples))
        self._staleness.append(result.staleness)
        self._samples += samples

    def flush(self, step: int, timings: dict[str, float], *, wait: bool = False) -> dict[str, Any]:
        """The interval's record (raises model.NonFiniteLossError on a non-finite loss).

        Without `wait`, the losses of steps still running move to the next interval
        (the oldest one is waited for when none is done yet).
        """
        done = len(self._losses)
        if not wait:
            done = next(
                (i for i, (loss, _) in enumerate(self._losses) if not loss.is_ready()), done
            )
            done = max(done, 1)
        finished, self._losses = self._losses[:done], self._losses[done:]
        losses = np.asarray(jax.device_get([loss for loss, _ in finished]), np.float64)
        self.samples_done += sum(samples for _, samples in finished)
        check_finite_losses(losses, step)
        seconds = time.perf_counter() - self._start - self._paused_seconds
        self.last_loss = float(losses.mean())
        record = {
            "loss": self.last_loss,
            "samples_per_s": self._samples / max(seconds, 1e-9),
            "staleness_mean": float(np.mean(self._staleness)),
            "staleness_max": int(np.max(self._staleness)),
            # steps finish behind their dispatch: what was trained by the time of this record
            "samples_done": self.samples_done,
            "seconds": seconds,
            **timings,
        }
        self._start_interval()
        return record

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A context whose time does not count as training time."""
        since = time.perf_counter()
        try:
            yield
        finally:
            self._paused_seconds += time.perf_counter() - since
