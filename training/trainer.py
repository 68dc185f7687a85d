"""The trainer behind `hybridrec train`: one loop for every run, start (or resume) to end.

A step, as in PERSIA (the overlap lives in `training/hybrid.py`):

    batch t ──► store.lookup_features (issued ahead, async) ──► devices
            ──► train_step (jitted, synchronous over the mesh)
            ──► embedding gradients ──► store.apply_pooled_gradients (async)

A run is configured by its source and its schedule:
  * source (`training/sources.py`): epochs of a dataset (`hybridrec train`), or a
    followed stream (`hybridrec train --follow`, `FollowOptions`);
  * schedule: logging, checkpoints and evaluation by steps (`log.every_steps`,
    `checkpoint.every_steps`, `eval.every_steps`), checkpoints and published exports by
    seconds (`FollowOptions.checkpoint_every`, `publish_every`).

`fit` reads top to bottom: the run directory (`RunCheckpoints`: config, resume point,
retention), the state and position, then one `HybridLoop` per segment of the source, where
logging, checkpoints, evaluation and publishing are each one schedule line.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from hybridrec.common.errors import UserError
from hybridrec.common.files import append_line
from hybridrec.common.progress import Progress
from hybridrec.embedding_store import EmbeddingStore
from hybridrec.embedding_store.remote.client import ServerSet
from hybridrec.training import stopping
from hybridrec.training.checkpoint import RunCheckpoints
from hybridrec.training.config import TrainConfig
from hybridrec.training.evaluate import evaluate
from hybridrec.training.follow_run import FollowOptions, InitialModel, stream_source
from hybridrec.training.job import Job
from hybridrec.training.meters import CompileMeter, IntervalMeter, StoreMeter, device_memory
from hybridrec.training.profiling import StepProfiler
from hybridrec.training.run_dir import clear_run_dir
from hybridrec.training.run_log import RunLog
from hybridrec.training.sources import EpochSource, Segment, StreamSource
from hybridrec.training.stopping import Patience
from hybridrec.training.tasks import prepare

SUMMARY_FILE = "summary.json"
PUBLISHED_FILE = "published.jsonl"  # one line per published export: step, version, position


def is_due(step: int, every: int, last: int | None) -> bool:
    """True at every `every`-th step (0 = never) and at the last step (if there is one)."""
    return step == last or (every > 0 and step % every == 0)


class Trainer:
    """Trains one run directory with the hybrid loop.

    Args:
        config: the run's configuration.
        run_dir: where metrics, checkpoints, TensorBoard files and the summary go.
        follow: train a stream dataset (`data.path`) until stopped, checkpointing by
            seconds; None: epochs of a dataset.
        publish: `publish(step) -> {"version": ...}` writes an export of checkpoint `step`
            (the command passes `serving.export_run`); called every
            `follow.publish_every` seconds and at the end.
        resume: continue from the newest complete checkpoint in run_dir.
        overwrite: start again in run_dir, deleting the run it holds once the config and
            the data are checked (`training.job.clear_run_dir` refuses anything else).
        distributed: coordinator / num_processes / process_id for multi-process jobs.
        quiet: no progress lines (tests, benchmarks).
        store: an embedding store to train instead of the one the config describes (its
            tables must be `plan_tables` of the config); the caller keeps ownership.
        servers: the remote shard servers as the command resolved them (see
            `training.tasks.prepare`).
    """

    def __init__(
        self,
        config: TrainConfig,
        run_dir: str | Path,
        *,
        follow: FollowOptions | None = None,
        publish: Callable[[int], dict[str, Any]] | None = None,
        resume: bool = False,
        overwrite: bool = False,
        distributed: dict[str, Any] | None = None,
        quiet: bool = False,
        store: EmbeddingStore | None = None,
        servers: ServerSet | None = None,
    ):
        self.run_dir = Path(run_dir)
        if overwrite and resume:
            raise UserError("--overwrite and --resume contradict each other")
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise UserError(f"--run-dir {self.run_dir}: a file, not a directory")
        path = config.data.path
        if path and "://" not in path and not Path(path).is_absolute():
            # saved in config.json as an absolute path: `evaluate`, `export` and `--resume`
            # find the data from any working directory
            data = dataclasses.replace(config.data, path=str(Path(path).resolve()))
            config = dataclasses.replace(config, data=data)
        self.follow = follow
        self.publish = publish
        self.resume = resume
        self.quiet = quiet
        self.job: Job = prepare(
            config, distributed=distributed, servers=servers, follow=follow is not None
        )
        if overwrite:  # once the config and the data have been checked
            if self.job.is_chief:
                clear_run_dir(self.run_dir, self.job.config.data.path)
            self.job.barrier("run-dir-cleared")
        self.checkpoints = RunCheckpoints(self.run_dir, keep=config.checkpoint.keep)
        self.checkpoints.check_start(resume=resume)  # before the start-up lines, not after
        if follow is None:
            # epochs of a dataset, or the task's stream (`StreamSource`'s interface)
            self.source: EpochSource | StreamSource = EpochSource(self.job)
        else:
            self.source = stream_source(self.job, follow)
        # the dense rate's "auto" decay needs the run's length, which the source knows; the
        # run's config.json keeps "auto", so that a run resumed with more steps decays to
        # its new end instead of training on at the rate's floor
        self._saved_config = self.job.config
        self.job, self.schedule = stopping.schedule_run(
            self.job,
            evaluates=self.source.evaluates,
            steps_per_epoch=getattr(self.source, "steps_per_epoch", 0),
            last_step=self.source.last_step,
            follow=follow is not None,
        )
        self.config = self.job.config
        self.checkpoints.keep_best = self.schedule.rule.metric
        last, step = self.source.last_step, self.checkpoints.latest_step() if resume else None
        if step is not None and last and step >= last and (self.run_dir / SUMMARY_FILE).exists():
            raise UserError(
                f"{self.run_dir} already finished: its checkpoint is step {step} and the run "
                f"ends at step {last} (data.max_steps, data.epochs); raise one of them "
                "(--set data.epochs=N) to train it further"
            )
        if step is not None:
            stopping.check_not_stopped(self.checkpoints, self.schedule.rule, step, self.job)
        self._given_store = store
        self.store = None
        self.loop = None
        self.init = None
        started = resume and self.checkpoints.latest_step() is not None
        if follow is not None and follow.init_from is not None and not started:
            self.init = InitialModel(self.job, follow.init_from, follow.init_step)
            self.job = dataclasses.replace(
                self.job,
                choices=(*self.job.choices, f"initial model: {follow.init_from}, step {self.init.step}"),
            )  # fmt: skip

    @property
    def is_chief(self) -> bool:
        return self.job.is_chief

    def fit(self, stop: threading.Event | None = None) -> dict[str, Any]:
        """Trains to the end of the source (or until `stop` is set); returns the summary
        (also written to summary.json)."""
        config, job, source = self.config, self.job, self.source
        stop = stop or threading.Event()
        resume_step = self.checkpoints.begin(
            self._saved_config, resume=self.resume, chief=self.is_chief
        )
        job.barrier("discarded-partial-checkpoints")
        self.state = job.new_state()
        saved = None
        if resume_step is not None:
            self.state = self.checkpoints.restore_dense(resume_step, self.state)
            saved = self.checkpoints.read_position(
                resume_step, job.process_index, job.process_count
            )
        elif self.init is not None:
            self.state = self.init.restore_dense(self.state)
        self.seconds = source.restore(saved)
        self.patience = Patience(self.schedule.rule, (saved or {}).get("stopping"))
        self.started = time.monotonic() - float((saved or {}).get("wall_seconds", 0.0))
        if self._given_store is not None and resume_step is not None:
            raise UserError("a given embedding store cannot resume a run: let the trainer open it")
        if self._given_store is None and resume_step is None and self.init is not None:
            self.store = self.init.open_store(job)
        else:
            self.store = self._given_store or job.open_store(self.checkpoints, resume_step)
        self.device_rows = job.device_rows(
            self.store
        )  # id -> row maps of the tables on the devices
        if self.device_rows is not None and resume_step is not None:
            self.state = self.device_rows.load(self.state, self.store)
        self.step = self.saved_step = resume_step or 0
        self.published_step = None
        self.last_save = self.last_publish = time.monotonic()
        self.eval_results: dict[str, float] = {}
        self.log = RunLog(
            self.run_dir,
            enabled=self.is_chief,
            tensorboard=config.log.tensorboard,
            resume_step=resume_step,
        )
        self.progress = None
        if self.is_chief and not self.quiet:
            total = source.last_step and source.last_step * config.data.batch_size
            self.progress = Progress(
                "train" if self.follow is None else "train --follow",
                total=total,
                unit="samples" if self.follow is None else "events" if source.windows else "rows",
                interval=config.log.progress_interval,
            )
            self.progress.count = source.trained()
        self.meter = IntervalMeter(samples_done=source.trained())
        self._progress_fields: dict[str, float] = {}
        self.store_meter = StoreMeter(self.store)
        self.compiles = CompileMeter()  # from here on: the steps' compiles, new shapes' too
        profile_from = config.log.profile_from if self.is_chief else 0
        self.profiler = StepProfiler(
            self.run_dir, profile_from, config.log.profile_steps, next_step=self.step + 1
        )
        self.train_step = job.train_step()
        self.eval_step = job.eval_step() if self.schedule.evaluates or source.windows else None
        try:
            for segment in source.segments(self.step, stop):
                if segment is None:  # idle: what is due by the clock
                    self._save_and_publish(*self._due_by_clock())
                else:
                    self._train(segment, stop)
            self._save()
            if self.publish:
                self._publish()
            if self.step == source.last_step and not self.eval_results and self.schedule.evaluates:
                # resumed at its last step (stopped after the final checkpoint, before its
                # summary): the final evaluation it did not get
                self._evaluate(self.step, final=True)
                self._keep_best(self.step)
            summary = self._summary()
        finally:
            self.profiler.close()  # a failed run's trace (never raises)
            self.compiles.close()
            self.log.close()
            if self._given_store is None:
                self.store.close()
            self.checkpoints.close()
        if self.progress:
            self.progress.close()
        self._write_summary(summary)
        return summary

    def _train(self, segment: Segment, stop: threading.Event) -> None:
        """Trains the segment's batches through one HybridLoop (fewer if `stop` is set)."""
        config, last = self.config, self.source.last_step
        with self.meter.paused():
            for window in segment.windows:  # evaluated before any of it is trained
                self._evaluate_window(window)
        self.loop = self.job.hybrid_loop(
            segment.batches,
            state=self.state,
            train_step=self.train_step,
            store=self.store,
            first_step=self.step + 1,
            rows=segment.rows,
            device_rows=self.device_rows,
        )
        with self.loop as loop:
            for index in range(segment.size):
                step = self.step + 1
                end = stop.is_set() or index == segment.size - 1
                save_now, publish_now = self._due_by_clock()
                eval_now = self.schedule.evaluates and is_due(step, self.patience.every, last)
                save_now = save_now or is_due(step, config.checkpoint.every_steps, last)
                save_now = save_now or (eval_now and bool(self.checkpoints.keep_best))
                loop_pauses = save_now or eval_now or publish_now
                self.profiler.before(step)
                result = loop.progress(quiesce=loop_pauses or end)
                if result is None:
                    raise UserError(f"the input ended before step {step} of {last or 'the stream'}")
                self.step, self.state = result.step, loop.state
                if self.profiler.tracing:  # the window holds training steps only
                    with self.meter.paused():
                        self.profiler.after(step, self.state, last=end or loop_pauses)
                rows = self.source.advance(result)
                self.meter.add(result, rows)
                if self.progress:
                    self.progress.update(rows, **self._progress_fields)
                if is_due(step, config.log.every_steps, last) or end:
                    self._log(step, wait=end)
                with self.meter.paused():  # saving and evaluating are not training time
                    if eval_now:  # first: the checkpoint keeps the evaluation's count
                        self._evaluate(step, final=step == last)
                    self._save_and_publish(save_now, publish_now)
                    if eval_now:
                        self._keep_best(step)
                if end or self.patience.exhausted:  # quiesced above: every update up to
                    break  # this step is applied; what the loop read ahead is not trained
                if loop_pauses:
                    loop.resume()

    def _log(self, step: int, *, wait: bool) -> None:
        record = self.meter.flush(step, self.loop.timings(), wait=wait)
        self.seconds += record.pop("seconds")
        self._progress_fields = {k: record[k] for k in ("loss", "staleness_mean")}
        held = self.store_meter.read(wait=wait)
        self.log.write(
            "train",
            step,
            store_bytes_held=held.get("bytes_held"),
            store_bytes_at_capacity=held.get("bytes_at_capacity"),
            **self.source.fields(),
            **record,
            **self.compiles.read(),  # since training started: cumulative
            learning_rate=self.state.learning_rate(step - 1),  # the dense rate of `step`
        )

    def _evaluate(self, step: int, *, final: bool) -> None:
        if self.job.shared_store:  # every process's updates applied before any reads rows
            self.job.barrier(f"evaluate-{step}")
        started = time.monotonic()
        self.eval_results = evaluate(
            self.job,
            self.state,
            self.store,
            self.eval_step,
            split=self.schedule.split,
            max_batches=0 if final else self.config.eval.max_batches,
            progress_name="evaluate" if final and self.progress else None,
        )
        self.log.write("eval", step, **self.eval_results)
        seconds = {"train_seconds": self.seconds, "wall_seconds": time.monotonic() - self.started}
        self.patience.update(step, self.eval_results, seconds)
        if self.patience.adaptive:  # the first evaluation of an auto interval, measured
            seconds = time.monotonic() - started
            note = self.patience.widen(self.seconds, seconds, self.job.process_count)
            if note:
                self.log.write("eval_interval", step, every_steps=self.patience.every)
                if self.progress:
                    self.progress.note(note)
        if self.patience.exhausted and self.progress:
            self.progress.note(f"stopping at step {step}: {self.patience.stopped}")

    def _evaluate_window(self, index: int) -> None:
        """An event stream's shard, evaluated before it is trained (window T -> T + 1)."""
        entry, results = self.source.evaluate_window(index, self.state, self.store, self.eval_step)
        if results is None:
            return  # no target: a file of new users' first events only
        self.log.write("window", self.step, window=index, source=entry.source, **results)
        if self.progress:
            shown = ", ".join(f"{k} {results[k]:.4f}" for k in ("hr@10", "ndcg@10", "auc") if k in results)  # fmt: skip
            self.progress.note(f"window {index} ({entry.source}): {shown} over {int(results['queries']):,} events before training")  # fmt: skip

    def _keep_best(self, step: int) -> None:
        """Records `step` as the best checkpoint if its metric is; the previous best, no
        longer protected, then goes (every process: Orbax coordinates the dense deletes)."""
        job, metric = self.job, self.config.checkpoint.keep_best
        if not metric:
            return
        better = job.is_chief and self.checkpoints.record_eval(step, self.eval_results)
        if better:
            self.log.write(
                "best", step, **{metric: self.eval_results[metric]}, **self.patience.best_seconds
            )
        job.barrier(f"best-checkpoint-{step}")
        if job.is_chief:
            self.checkpoints.prune()
        self.checkpoints.prune_dense()

    def _due_by_clock(self) -> tuple[bool, bool]:
        """(checkpoint due, publish due) by the follow options' seconds."""
        if self.follow is None:
            return False, False
        now = time.monotonic()
        every = self.follow.checkpoint_every
        publish_every = self.follow.publish_every if self.publish else 0
        return (
            bool(every and now - self.last_save >= every),
            bool(publish_every and now - self.last_publish >= publish_every),
        )

    def _save_and_publish(self, save: bool, publish: bool) -> None:
        if save:
            self._save()
        if publish:
            self._publish()

    def _save(self) -> None:
        """Dense state, the source's position and embeddings at this step, then the commit
        marker (old checkpoints beyond `checkpoint.keep` go).

        The loop is quiesced: every update up to the step is applied, no later lookup has
        reached the store.
        """
        self.last_save = time.monotonic()
        step, job = self.step, self.job
        if step == self.saved_step:
            return
        self.checkpoints.save_dense(step, self.state)
        record = {
            **self.source.record(),
            "seconds": self.seconds,
            "wall_seconds": time.monotonic() - self.started,
            "stopping": self.patience.record(),
        }
        self.checkpoints.save_position(step, job.process_index, record)
        job.barrier(f"checkpoint-parts-{step}")
        if job.is_chief:  # replicas are identical; remote shards are shared
            self.store.checkpoint(
                self.checkpoints.embeddings_url, step, precision=self.config.checkpoint.precision
            )
        job.barrier(f"checkpoint-embeddings-{step}")
        if job.is_chief:
            self.checkpoints.commit(step)
        if self.checkpoints.keep_best:  # old dense steps, but the best (every process)
            job.barrier(f"checkpoint-commit-{step}")
            self.checkpoints.prune_dense()
        self.saved_step = step

    def _publish(self) -> None:
        """Exports the newest step (checkpointed first) and appends it to published.jsonl."""
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
            **self.source.published(),
            "published_unix": time.time(),
            "seconds": round(time.time() - started, 3),
        }
        append_line(self.run_dir / PUBLISHED_FILE, json.dumps(record))
        if self.progress:
            print(
                f"[train --follow] published version {record['version']} ({record['kind']}, "
                f"{(record['export_bytes'] or 0) / 2**20:.1f} MiB, step {self.step}) in "
                f"{record['seconds']:.1f}s",
                file=sys.stderr,
                flush=True,
            )

    def _summary(self) -> dict[str, Any]:
        gate = self.loop.gate if self.loop is not None else None
        return {
            "steps": int(self.step),
            **self.source.summary(),
            "train_seconds": round(self.seconds, 3),
            "samples_per_s": self.source.trained() / self.seconds if self.seconds else None,
            **self._tokens_per_s(),
            "final_loss": self.meter.last_loss,
            "eval": self.eval_results,
            **self.patience.summary(stopped_at_cap=self.step == self.source.last_step),
            "staleness_bound": self.config.hybrid.staleness,
            "staleness_max": int(gate.max_staleness) if gate else 0,
            "staleness_histogram": gate.histogram.tolist() if gate else [],
            # XLA compiles while training, and their seconds (a new batch shape compiles)
            **self.compiles.read(),
            # totals over all tables (rows, bytes, admissions, evictions, cold-tier traffic)
            "embedding_store": {
                key: value for key, value in self.store.stats().items() if key != "tables"
            },
            # tables trained on the devices: rows held each, and the share of lookups there
            "device_tables": self.device_rows.summary() if self.device_rows else {},
            "processes": self.job.process_count,
            "hybridrec_version": metadata.version("hybridrec"),
            "devices": int(self.job.mesh.devices.size),
            "device_kind": self.job.mesh.devices.flat[0].device_kind,
            # peak and limit per device (None where the backend reports none, as on CPU)
            "device_memory": device_memory(),
            # log.profile_from: the traced steps' busy threads and top operations
            "profile": self.profiler.summary,
            "run_dir": str(self.run_dir),
            "checkpoint_step": self.checkpoints.latest_step(),
            "metrics_file": str(self.run_dir / "metrics.jsonl"),
            "tensorboard_dir": str(self.run_dir / "tensorboard"),
        }

    def _tokens_per_s(self) -> dict[str, float]:
        """Sequence runs: the positions trained per second."""
        tokens = getattr(self.source, "tokens", 0)
        return {"tokens_per_s": tokens / self.seconds} if tokens and self.seconds else {}

    def _write_summary(self, summary: dict[str, Any]) -> None:
        text = json.dumps(summary, indent=2) + "\n"
        if self.is_chief:
            (self.run_dir / SUMMARY_FILE).write_text(text)
        if self.job.process_count > 1:  # each process's own view, to compare across processes
            own = self.run_dir / "processes" / f"summary_{self.job.process_index}.json"
            own.parent.mkdir(exist_ok=True)
            own.write_text(text)
