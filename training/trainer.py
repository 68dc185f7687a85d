"""The hybrid trainer behind `hybridrec train` and `hybridrec evaluate` (see hybridrec.train).

One training step, as in PERSIA:

    batch t ──► store.lookup_features (issued up to k batches ahead, async)
            ──► make_global_batch ──► train_step (jitted, synchronous over the mesh)
            ──► embedding gradients ──► store.apply_pooled_gradients (async)

The lookahead and the staleness bound live in `training/hybrid.py`; checkpoints in
`training/checkpoint.py`; the input stream in `training/input.py`.

Where the embedding store lives in a job of several processes:
* with `embedding.servers` (remote shards, the PERSIA layout) all processes share one
  store; each reads its own share of the files and pushes its own gradients;
* with in-process shards every process holds a full replica: each reads the whole
  global batch stream (deterministically), trains on its slice of it, and applies
  the all-gathered gradients of the global batch, so the replicas stay identical.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from common import config as config_lib
from common.errors import UserError
from common.progress import Progress
from embedding_store import EmbeddingStore
from embedding_store.remote import connect, resolve_addresses
from model import (
    StreamingMetrics,
    create_train_state,
    local_rows,
    make_eval_step,
    make_global_batch,
    make_mesh,
    make_train_step,
    maybe_initialize_distributed,
)
from pipeline import read_metadata
from training.checkpoint import RunCheckpoints
from training.config import PRESET_DIR, TrainConfig
from training.hybrid import LookaheadPipeline, StalenessGate, UpdatePusher, feature_ids
from training.input import DataPosition, ParquetReader
from training.run_log import RunLog

CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"


class TrainingDivergedError(UserError):
    """The loss became NaN or infinite."""


@dataclasses.dataclass
class _Context:
    """What training and evaluation share: devices, data layout, model functions, store."""

    config: TrainConfig
    metadata: Any
    mesh: Any
    process_index: int
    process_count: int
    replicated_store: bool  # in-process shards in a multi-process job: one replica each
    servers: tuple[str, ...]  # remote shard servers (config or $HYBRIDREC_EMBEDDING_SERVERS)
    feature_tables: dict[str, str]
    tables: list[Any]
    state: Any = None
    store: Any = None

    @property
    def num_features(self) -> int:
        return len(self.feature_tables)

    def reader(self, split: str, *, batch_size: int, train: bool) -> tuple[ParquetReader, slice]:
        """A reader of `split` and the rows of each of its batches this process uses.

        Normally each process reads its own share of the files in local batches (slice
        = all rows). Training with replicated in-process stores, or a split with fewer
        files than processes, reads the global batch stream on every process instead
        and the slice picks this process's rows.
        """
        columns = self.metadata
        single = [f.name for f in columns.categorical if not f.multi_valued]
        multi = [f.name for f in columns.categorical if f.multi_valued]
        files = self.metadata.split_files(split)
        if not files:
            raise UserError(f"{self.config.data.path}: split {split!r} has no files")
        whole = (train and self.replicated_store) or len(files) < self.process_count
        local_size = batch_size // self.process_count
        rows = slice(None)
        if whole and self.process_count > 1:
            rows = slice(self.process_index * local_size, (self.process_index + 1) * local_size)
        reader = ParquetReader(
            files,
            label=columns.label_column,
            dense=list(columns.dense_columns),
            single=single,
            multi=multi,
            batch_size=batch_size if whole else local_size,
            seed=self.config.seed,
            shuffle_buffer=self.config.data.shuffle_buffer if train else 0,
            shard_index=0 if whole else self.process_index,
            shard_count=1 if whole else self.process_count,
            pad_final=not train,
        )
        return reader, rows

    def gather(self, array: np.ndarray) -> np.ndarray:
        """Concatenates every process's rows in process order (a collective when multi-process)."""
        if self.process_count == 1:
            return array
        gathered = multihost_utils.process_allgather(array)
        return gathered.reshape(-1, *array.shape[1:])


def _setup(config: TrainConfig, *, distributed: dict[str, Any]) -> _Context:
    maybe_initialize_distributed(**distributed)
    if not config.data.path:
        raise UserError(
            "no data: pass --data DIR (a `hybridrec preprocess` output) or set data.path"
        )
    metadata = read_metadata(config.data.path)
    mesh = make_mesh(config.mesh)
    process_count, process_index = jax.process_count(), jax.process_index()
    devices = mesh.devices.size
    for name, size in (
        ("data.batch_size", config.data.batch_size),
        ("data.eval_batch_size", config.data.eval_batch_size or config.data.batch_size),
    ):
        if size % devices or size % process_count:
            raise UserError(
                f"{name} = {size} must divide evenly over {devices} devices and {process_count} processes"
            )
    feature_tables = {f.name: f.table for f in metadata.categorical}
    tables = [config.embedding.table(name) for name in dict.fromkeys(feature_tables.values())]
    servers = tuple(resolve_addresses(config.embedding.servers) or ())
    return _Context(
        config=config,
        metadata=metadata,
        mesh=mesh,
        process_index=process_index,
        process_count=process_count,
        replicated_store=process_count > 1 and not servers,
        servers=servers,
        feature_tables=feature_tables,
        tables=tables,
    )


DEFAULT_LOCAL_SHARDS = 4  # in-process shards when embedding.num_shards is not set


def _open_store(
    context: _Context,
    checkpoints: RunCheckpoints | None,
    step: int | None,
    *,
    remote: bool = True,
) -> EmbeddingStore:
    """The run's embedding store, restored to `step` when given.

    Remote shards are shared by every process, so only process 0 loads a checkpoint
    onto them and the others attach after it is done. With `remote=False` (evaluating
    a checkpoint) the rows are restored into in-process shards even when servers are
    configured, so the servers' live rows are never rolled back.
    """
    tables = context.tables
    if not (remote and context.servers):
        num_shards = context.config.embedding.num_shards or DEFAULT_LOCAL_SHARDS
        if step is None:
            return EmbeddingStore(tables, num_shards=num_shards)
        return EmbeddingStore.restore(
            checkpoints.embeddings_url, tables, step=step, num_shards=num_shards
        )
    shards = connect(list(context.servers), tables)
    expected = context.config.embedding.num_shards
    if expected is not None and expected != len(shards):
        raise UserError(
            f"embedding.num_shards = {expected}, but the servers {', '.join(context.servers)} "
            f"host {len(shards)} shards; leave embedding.num_shards unset with servers"
        )
    if step is None or context.process_index != 0:
        _barrier(context, f"restore-embeddings-{step}")
        return EmbeddingStore(tables, num_shards=len(shards), shards=shards)
    store = EmbeddingStore.restore(
        checkpoints.embeddings_url, tables, step=step, num_shards=len(shards), shards=shards
    )
    _barrier(context, f"restore-embeddings-{step}")
    return store


def _new_state(context: _Context) -> Any:
    config = context.config
    return create_train_state(
        config.model,
        config.optimizer,
        context.mesh,
        jax.random.key(config.seed),
        num_dense=len(context.metadata.dense_columns),
        num_features=context.num_features,
        embedding_dim=config.embedding.dim,
    )


def _barrier(context: _Context, name: str) -> None:
    if context.process_count > 1:
        multihost_utils.sync_global_devices(name)


def evaluate(
    context: _Context,
    eval_step: Any,
    *,
    max_batches: int = 0,
    split: str | None = None,
    progress_name: str | None = None,
) -> dict[str, float]:
    """AUC, logloss, NE and calibration of the current state on a split (all processes).

    Every process evaluates its own share of the files; predictions are gathered so
    every process returns the same numbers.
    """
    config = context.config
    batch_size = config.data.eval_batch_size or config.data.batch_size
    reader, rows = context.reader(
        split or config.data.eval_split, batch_size=batch_size, train=False
    )
    num_batches = reader.batches_per_epoch
    if max_batches:
        num_batches = min(num_batches, max_batches)
    metrics = StreamingMetrics()
    progress = Progress(progress_name, total=num_batches, unit="batches") if progress_name else None
    for batch in reader.batches(num_batches=num_batches):
        pooled = context.store.lookup_features(
            feature_ids(batch, rows),
            feature_tables=context.feature_tables,
            pooling=config.embedding.pooling,
            train=False,  # evaluation neither admits ids nor counts sightings
        ).result()
        global_batch = make_global_batch(
            {
                "embeddings": pooled.embeddings,
                "dense": batch.dense[rows],
                "labels": batch.labels[rows],
            },
            context.mesh,
        )
        with jax.transfer_guard("disallow"):
            probabilities = eval_step(context.state, global_batch)
        local = local_rows(probabilities)
        probs, labels, valid = (
            context.gather(local),
            context.gather(batch.labels[rows]),
            context.gather(batch.valid[rows]),
        )
        metrics.update(probs[valid], labels[valid])
        if progress:
            progress.update(1)
    if progress:
        progress.close()
    return {key: float(value) for key, value in metrics.result().items()}


class _PhaseTimes:
    """Where the trainer's main thread spends a step (milliseconds per step, per log interval)."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self.steps = 0

    def add(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.totals[name] = self.totals.get(name, 0.0) + (now - since) * 1e3
        if name == "wait_ms":
            self.steps += 1
        return now

    def per_step(self) -> dict[str, float]:
        out = {name: round(total / max(self.steps, 1), 2) for name, total in self.totals.items()}
        self.totals, self.steps = {}, 0
        return out


class HybridTrainer:
    """Trains one run directory with the hybrid loop (see the module docstring).

    Args:
        config: the run's configuration.
        run_dir: where metrics, checkpoints, TensorBoard files and the summary go.
        resume: continue from the newest complete checkpoint in run_dir.
        distributed: coordinator / num_processes / process_id for multi-process jobs.
        quiet: no progress lines (tests, benchmarks).
    """

    def __init__(
        self,
        config: TrainConfig,
        run_dir: str | Path,
        *,
        resume: bool = False,
        distributed: dict[str, Any] | None = None,
        quiet: bool = False,
    ):
        self.config = config
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.quiet = quiet
        self.context = _setup(config, distributed=distributed or {})
        self.checkpoints = RunCheckpoints(self.run_dir, keep=config.checkpoint.keep)
        self.gate = StalenessGate(config.hybrid.staleness)
        self._lookup_lock = threading.Lock()
        self._lookups_paused = False
        self.staleness_histogram = np.zeros(config.hybrid.staleness + 1, np.int64)

    @property
    def is_chief(self) -> bool:
        return self.context.process_index == 0

    def _prepare_run_dir(self) -> int | None:
        """Creates run_dir; returns the step to resume from (None = fresh start)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        step = self.checkpoints.latest_step()
        if step is not None and not self.resume:
            raise UserError(
                f"{self.run_dir} already holds a checkpoint (step {step}); pass --resume to "
                "continue it or --overwrite to start again"
            )
        if self.is_chief:
            (self.run_dir / CONFIG_FILE).write_text(
                json.dumps(config_lib.to_dict(self.config), indent=2) + "\n"
            )
        return step

    def _issue_lookup(self, step: int, batch) -> Any:
        self.context.store.set_step(step)
        # replicas look up (and later update) the whole global batch; a shared store only
        # this process's rows
        rows = None if self.context.replicated_store else self._rows
        return self.context.store.lookup_features(
            feature_ids(batch, rows),
            feature_tables=self.context.feature_tables,
            pooling=self.config.embedding.pooling,
        )

    def _save(self, step: int, position: DataPosition, counters: dict[str, Any]) -> None:
        """Dense state, data position and embeddings at `step`, then the commit marker."""
        context = self.context
        self._pusher.drain()  # every update up to `step` is in the store ...
        context.store.flush()  # ... and applied
        self.checkpoints.save_dense(step, context.state)
        self.checkpoints.save_position(
            step, context.process_index, {"position": position.to_dict(), **counters}
        )
        _barrier(context, f"checkpoint-parts-{step}")
        if self.is_chief:  # replicas are identical; remote shards are shared
            context.store.checkpoint(self.checkpoints.embeddings_url, step)
        _barrier(context, f"checkpoint-embeddings-{step}")
        if self.is_chief:
            self.checkpoints.commit(step)

    def fit(self) -> dict[str, Any]:
        """Runs training to the end; returns the summary (also written to summary.json)."""
        config, context = self.config, self.context
        resume_step = self._prepare_run_dir()
        context.state = _new_state(context)
        position, counters = DataPosition(), {"samples": 0, "seconds": 0.0}
        # parts of checkpoints never committed (a run killed mid-save) are removed first
        self.checkpoints.discard_after(resume_step or 0, chief=self.is_chief)
        _barrier(context, "discarded-partial-checkpoints")
        if resume_step is not None:
            context.state = self.checkpoints.restore_dense(resume_step, context.state)
            saved = self.checkpoints.read_position(resume_step, context.process_index)
            position = DataPosition.from_dict(saved["position"])
            counters = {"samples": saved["samples"], "seconds": saved["seconds"]}
        context.store = _open_store(context, self.checkpoints, resume_step)
        first_step = (resume_step or 0) + 1

        train_step = make_train_step(config.model, context.mesh)
        eval_step = make_eval_step(config.model, context.mesh)
        reader, self._rows = context.reader(
            config.data.train_split, batch_size=config.data.batch_size, train=True
        )
        total_steps = config.data.max_steps or config.data.epochs * reader.batches_per_epoch
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
                total=total_steps * config.data.batch_size,
                unit="samples",
                interval=config.log.progress_interval,
            )
            progress.count = counters["samples"]
        lookahead = LookaheadPipeline(
            reader.batches(num_batches=total_steps, position=position),
            first_step=first_step,
            issue_lookup=self._issue_lookup,
            gate=self.gate,
            prefetch=config.data.prefetch,
            lookup_lock=self._lookup_lock,
            # with k = 0 the step always waits for the store: nothing to yield to
            nice=config.hybrid.background_nice if config.hybrid.staleness else 0,
            lookahead=config.hybrid.lookahead,
        )
        self._pusher = UpdatePusher(
            lambda lookup, grads: context.store.apply_pooled_gradients(lookup, grads),
            self.gate,
            background=config.hybrid.background_apply,
            nice=config.hybrid.background_nice if config.hybrid.staleness else 0,
        )
        eval_results: dict[str, float] = {}
        try:
            eval_results = self._loop(
                lookahead, train_step, eval_step, first_step, total_steps, counters, log, progress
            )
        finally:
            self._pusher.close()
            if self._lookups_paused:  # an error between pausing and saving
                self._lookups_paused = False
                self._lookup_lock.release()
            lookahead.close()
            log.close()
        if progress:
            progress.close()
        summary = self._summary(total_steps, counters, eval_results)
        if self.is_chief:
            (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        if context.process_count > 1:  # each process's own view, to compare across processes
            own = self.run_dir / "processes" / f"summary_{context.process_index}.json"
            own.parent.mkdir(exist_ok=True)
            own.write_text(json.dumps(summary, indent=2) + "\n")
        context.store.close()
        self.checkpoints.close()
        return summary

    def _loop(
        self, lookahead, train_step, eval_step, first_step, total_steps, counters, log, progress
    ):
        config, context = self.config, self.context
        batch_size = config.data.batch_size
        local = self._rows
        pending_losses: list[Any] = []
        phases = _PhaseTimes()
        progress_fields: dict[str, float] = {}
        interval_staleness: list[int] = []
        interval_start, interval_samples = time.perf_counter(), 0
        last_loss = float("nan")
        eval_results: dict[str, float] = {}
        step = first_step - 1
        position = None
        while True:
            clock = time.perf_counter()
            item = lookahead.next()
            if item is None:
                break
            step, batch, position = item.step, item.batch, item.batch.position
            self.staleness_histogram[item.staleness] += 1
            interval_staleness.append(item.staleness)
            pooled = item.lookup.result()
            clock = phases.add("wait_ms", clock)
            global_batch = make_global_batch(
                {
                    "embeddings": pooled.embeddings[local]
                    if context.replicated_store
                    else pooled.embeddings,
                    "dense": batch.dense[local],
                    "labels": batch.labels[local],
                },
                context.mesh,
            )
            clock = phases.add("to_device_ms", clock)
            with jax.transfer_guard("disallow"):
                context.state, metrics, embedding_grads = train_step(context.state, global_batch)
            pending_losses.append(metrics["loss"])
            grads = local_rows(embedding_grads)
            if context.replicated_store:
                grads = context.gather(grads)  # the global batch's gradients, on every replica
            clock = phases.add("step_ms", clock)
            checkpoint_now = step == total_steps or (
                config.checkpoint.every_steps and step % config.checkpoint.every_steps == 0
            )
            if checkpoint_now:
                # no lookahead lookup may slip between this update and the snapshot
                self._lookup_lock.acquire()
                self._lookups_paused = True
            self._pusher.push(pooled, grads)
            phases.add("apply_ms", clock)
            interval_samples += batch_size
            counters["samples"] += batch_size
            if progress:
                progress.update(batch_size, **progress_fields)
            if step % config.log.every_steps == 0 or step == total_steps:
                losses = np.asarray(jax.device_get(pending_losses), np.float64)
                pending_losses = []
                last_loss = float(losses.mean())
                if not np.all(np.isfinite(losses)):
                    raise TrainingDivergedError(
                        f"loss is {losses[~np.isfinite(losses)][0]} at or before step {step}; "
                        "lower optimizer.learning_rate or embedding.optimizer.learning_rate"
                    )
                elapsed = time.perf_counter() - interval_start
                counters["seconds"] += elapsed
                staleness_mean = float(np.mean(interval_staleness))
                progress_fields = {"loss": last_loss, "staleness": staleness_mean}
                log.write(
                    "train",
                    step,
                    loss=last_loss,
                    samples_per_s=interval_samples / max(elapsed, 1e-9),
                    staleness_mean=staleness_mean,
                    staleness_max=int(np.max(interval_staleness)),
                    samples=counters["samples"],
                    **phases.per_step(),
                )
                interval_start, interval_samples, interval_staleness = time.perf_counter(), 0, []
            if checkpoint_now:
                paused = time.perf_counter()
                try:
                    self._save(step, position, counters)
                finally:
                    self._lookups_paused = False
                    self._lookup_lock.release()
                interval_start += time.perf_counter() - paused  # saving is not training time
            if step == total_steps or (
                config.eval.every_steps and step % config.eval.every_steps == 0
            ):
                paused = time.perf_counter()
                self._pusher.drain()
                context.store.flush()
                final = step == total_steps
                eval_results = evaluate(
                    context,
                    eval_step,
                    max_batches=0 if final else config.eval.max_batches,
                    progress_name="evaluate"
                    if final and self.is_chief and not self.quiet
                    else None,
                )
                log.write("eval", step, **eval_results)
                interval_start += time.perf_counter() - paused
        self._pusher.drain()
        context.store.flush()
        self.last_step = step
        self.last_loss = last_loss
        return eval_results

    def _summary(self, total_steps, counters, eval_results) -> dict[str, Any]:
        seconds = counters["seconds"]
        return {
            "steps": int(total_steps),
            "samples": int(counters["samples"]),
            "train_seconds": round(seconds, 3),
            "samples_per_s": counters["samples"] / seconds if seconds else None,
            "final_loss": getattr(self, "last_loss", None),
            "eval": eval_results,
            "staleness_bound": self.config.hybrid.staleness,
            "staleness_max": int(self.gate.max_staleness),
            "staleness_histogram": self.staleness_histogram.tolist(),
            # totals over all tables (rows, admissions, evictions, cold-tier traffic, ...)
            "embedding_store": {
                key: value for key, value in self.context.store.stats().items() if key != "tables"
            },
            "processes": self.context.process_count,
            "devices": int(self.context.mesh.devices.size),
            "run_dir": str(self.run_dir),
            "checkpoint_step": self.checkpoints.latest_step(),
            "metrics_file": str(self.run_dir / "metrics.jsonl"),
            "tensorboard_dir": str(self.run_dir / "tensorboard"),
        }


def load_config(
    preset: str | None, overrides: list[str], run_dir: Path | None = None
) -> TrainConfig:
    """The preset (or, without one, the config saved in run_dir) plus overrides."""
    if preset is None and run_dir is not None and (run_dir / CONFIG_FILE).exists():
        saved = json.loads((run_dir / CONFIG_FILE).read_text())
        try:
            return config_lib.from_dict(TrainConfig, config_lib.apply_overrides(saved, overrides))
        except UserError as error:
            raise UserError(f"{run_dir / CONFIG_FILE}: {error}") from None
    return config_lib.load(TrainConfig, preset, overrides, preset_dir=PRESET_DIR)


def evaluate_checkpoint(
    run_dir: str | Path,
    *,
    step: int | None = None,
    split: str | None = None,
    overrides: list[str] = (),
    distributed: dict[str, Any] | None = None,
    quiet: bool = True,
) -> dict[str, Any]:
    """Evaluates the checkpoint of `run_dir` at `step` (default: the newest complete one)."""
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).exists():
        raise UserError(f"{run_dir}: not a run directory (no {CONFIG_FILE})")
    config = load_config(None, list(overrides), run_dir)
    context = _setup(config, distributed=distributed or {})
    checkpoints = RunCheckpoints(run_dir, keep=config.checkpoint.keep)
    step = step if step is not None else checkpoints.latest_step()
    if step is None:
        raise UserError(f"{run_dir}: no complete checkpoint to evaluate")
    context.state = checkpoints.restore_dense(step, _new_state(context))
    context.store = _open_store(context, checkpoints, step, remote=False)
    eval_step = make_eval_step(config.model, context.mesh)
    try:
        results = evaluate(
            context,
            eval_step,
            split=split,
            progress_name=None if quiet or context.process_index else "evaluate",
        )
    finally:
        context.store.close()
        checkpoints.close()
    results = {"step": step, "split": split or config.data.eval_split, **results}
    if context.process_index == 0:
        out = run_dir / "eval" / f"step_{step:08d}_{results['split']}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")
        results["output"] = str(out)
    return results
