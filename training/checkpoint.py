"""Checkpoints of a hybrid run: dense state, data position and embeddings at ONE step.

Layout under `RUN_DIR/checkpoints/`:

    dense/<step>/            Orbax checkpoint of the dense train state (every process)
    positions/<step>/process_<i>.json   each process's input position + counters
    embeddings/              the embedding store's own checkpoints (store.checkpoint)
    LAST                     {"step": N}: the newest *complete* checkpoint

Each part is written atomically by its owner (Orbax renames a finished temporary
directory; the store commits a manifest last; position files are renamed into
place). `LAST` is replaced (write temporary, fsync, rename) only after all three
parts of step N exist, so a process killed at any moment leaves `LAST` naming a
complete checkpoint; parts of a newer, unfinished step are ignored and removed on
resume (`discard_after`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from hybridrec.common import config as config_lib
from hybridrec.common.errors import UserError
from hybridrec.common.files import atomic_write_text
from hybridrec.embedding_store import checkpoint as store_checkpoint

CONFIG_FILE = "config.json"  # a run directory's config, as trained
CHECKPOINT_DIR = "checkpoints"
LAST_FILE = "LAST"
BEST_FILE = "BEST"  # {"step", "metric", "value"}: the kept best checkpoint (keep_best)
LOWER_IS_BETTER = ("logloss", "ne", "loss")


def make_checkpoint_manager(directory: str | Path, *, keep: int) -> ocp.CheckpointManager:
    """The one place that builds the Orbax manager for dense state (synchronous saves)."""
    options = ocp.CheckpointManagerOptions(
        # one more than asked: the step LAST points to must survive the next save
        max_to_keep=keep + 1 if keep > 0 else None,
        create=True,
        enable_async_checkpointing=False,
    )
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


class RunCheckpoints:
    """Saves and finds complete checkpoints of one run directory.

    Args:
        run_dir: the run directory.
        keep: complete checkpoints to keep (older dense/position parts are removed).
        keep_best: an eval metric: the checkpoint with its best value (`record_eval`) is
            kept too (`checkpoint.keep_best`).
    """

    def __init__(self, run_dir: str | Path, *, keep: int = 2, keep_best: str = ""):
        self.root = Path(run_dir).absolute() / CHECKPOINT_DIR
        self.keep = keep
        self.keep_best = keep_best
        self.embeddings_url = str(self.root / "embeddings")
        self._manager: ocp.CheckpointManager | None = None

    @property
    def manager(self) -> ocp.CheckpointManager:
        """The Orbax manager of `checkpoints/dense/`, built on first use (keeping a best
        checkpoint, `prune_dense` removes the old steps instead of Orbax)."""
        if self._manager is None:
            keep = 0 if self.keep_best else self.keep
            self._manager = make_checkpoint_manager(self.root / "dense", keep=keep)
        return self._manager

    def best(self) -> dict[str, Any] | None:
        """{"step", "metric", "value"} of the kept best checkpoint, or None."""
        path = self.root / BEST_FILE
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError as error:
            raise UserError(f"{path}: unreadable best-checkpoint record: {error}") from None

    def record_eval(self, step: int, results: dict[str, Any]) -> bool:
        """Makes the complete checkpoint `step` the best when its `keep_best` metric beats
        the best so far (process 0 only); returns whether it did."""
        if not self.keep_best or step != self.latest_step():
            return False
        if self.keep_best not in results:
            have = ", ".join(sorted(k for k, v in results.items() if isinstance(v, float)))
            raise UserError(
                f"checkpoint.keep_best = {self.keep_best!r} is not an eval metric of this run "
                f"(it has {have})"
            )
        value = float(results[self.keep_best])
        best = self.best()
        lower = self.keep_best in LOWER_IS_BETTER
        same = best is not None and best.get("metric") == self.keep_best
        if same and ((value >= best["value"]) if lower else (value <= best["value"])):
            return False
        record = {"step": int(step), "metric": self.keep_best, "value": value}
        atomic_write_text(self.root / BEST_FILE, json.dumps(record))
        return True

    def protected(self) -> tuple[int, ...]:
        """Steps kept whatever their age: the best checkpoint's."""
        best = self.best() if self.keep_best else None
        return (int(best["step"]),) if best else ()

    def prune_dense(self) -> None:
        """Keeping a best checkpoint: removes the dense steps that are neither among the
        newest `keep` (+1, the one LAST may still point to while the next is written) nor the
        best. Call on every process (Orbax coordinates its deletes)."""
        if not self.keep_best:
            return
        steps = sorted(self.manager.all_steps())
        kept = set(steps[-(self.keep + 1) :]) | set(self.protected())
        for step in steps:
            if step not in kept:
                self.manager.delete(step)

    def begin(self, config: Any, *, resume: bool, chief: bool) -> int | None:
        """Starts (or resumes) training in the run directory; returns the step to resume
        from, None for a fresh start.

        Call on every process, then wait at a barrier: it refuses a directory that holds
        a checkpoint unless `resume`, writes the run's config (the chief), and removes
        the parts of checkpoints never committed (a run killed mid-save).
        """
        run_dir = self.root.parent
        run_dir.mkdir(parents=True, exist_ok=True)
        step = self.check_start(resume=resume)
        if chief:
            text = json.dumps(config_lib.to_dict(config), indent=2) + "\n"
            atomic_write_text(run_dir / CONFIG_FILE, text)
        self.discard_after(step or 0, chief=chief)
        return step

    def check_start(self, *, resume: bool) -> int | None:
        """The step a run starting here resumes from (None: a fresh start); a UserError
        when the directory holds a checkpoint and `resume` is not asked for."""
        step = self.latest_step()
        if step is not None and not resume:
            raise UserError(
                f"{self.root.parent} already holds a checkpoint (step {step}); pass --resume "
                "to continue it or --overwrite to start again"
            )
        return step

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None."""
        path = self.root / LAST_FILE
        if not path.exists():
            return None
        try:
            return int(json.loads(path.read_text())["step"])
        except (ValueError, KeyError) as error:
            raise UserError(f"{path}: unreadable checkpoint pointer: {error}") from None

    def resolve_step(self, step: int | str | None, purpose: str) -> int:
        """The step `choose_step` picks (without its reason)."""
        return self.choose_step(step, purpose)[0]

    def choose_step(self, step: int | str | None, purpose: str) -> tuple[int, str]:
        """(step, why) of the checkpoint to `purpose` (e.g. "export"): `step` when the run
        holds a complete checkpoint of it; "best": the kept best (`checkpoint.keep_best`);
        "latest": the newest complete one; None: the best when the run recorded one, else
        the newest. A one-line UserError when there is none, naming what to do."""
        run_dir = self.root.parent
        best = self.best()
        if step is None and best is not None and int(best["step"]) in self.complete_steps():
            step = "best"
        if step == "best":
            if best is None:
                raise UserError(
                    f"{run_dir}: no best checkpoint recorded (a run keeps one when it evaluates "
                    "a validation split: checkpoint.keep_best = auto or a metric); use --step "
                    "latest or a step number"
                )
            return int(best["step"]), (
                f"the best checkpoint: validation {best['metric']} {best['value']:.4f} "
                "(--step latest: the newest)"
            )
        if step in (None, "latest"):
            latest = self.latest_step()
            if latest is None:
                raise UserError(
                    f"{run_dir}: no complete checkpoint to {purpose} (training stopped before "
                    f"its first); continue it with `hybridrec train --resume --run-dir {run_dir}`"
                )
            return latest, "the newest checkpoint" + (
                "" if step == "latest" else " (the run recorded no best)"
            )
        complete = self.complete_steps()
        if step not in complete:
            have = ", ".join(map(str, complete)) or "none"
            raise UserError(
                f"{run_dir}: no complete checkpoint at step {step} (complete steps: {have})"
            )
        return int(step), "as asked (--step)"

    def complete_steps(self) -> list[int]:
        """Steps of the complete checkpoints still in the run directory, ascending: those
        up to `latest_step()` whose dense state, positions and embeddings all exist."""
        latest = self.latest_step()
        if latest is None:
            return []
        positions = {
            int(path.name) for path in (self.root / "positions").glob("*") if path.name.isdigit()
        }
        embeddings = set(store_checkpoint.committed_steps(self.embeddings_url))
        complete = set(self.manager.all_steps()) & positions & embeddings
        return sorted(step for step in complete if step <= latest)

    def save_dense(self, step: int, state: Any) -> None:
        """Saves the dense state (call on every process; returns when written). Device
        tables are not part of it: their rows are saved with the store's."""
        if step in self.manager.all_steps():
            self.manager.delete(step)  # left over from a run killed before its LAST
        self.manager.save(step, args=ocp.args.StandardSave(_dense(state)))
        self.manager.wait_until_finished()

    def save_position(self, step: int, process_index: int, position: dict[str, Any]) -> None:
        """Atomically writes one process's input position and counters for `step`.

        Args:
            step: the checkpoint step.
            process_index: the writing process; each process writes its own file
                `positions/<step>/process_<process_index>.json`.
            position: a JSON-serializable dict (the reader position and run counters).
        """
        directory = self.root / "positions" / f"{step:010d}"
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_text(directory / f"process_{process_index}.json", json.dumps(position))

    def commit(self, step: int) -> None:
        """Marks step complete (process 0 only, after every part of every process exists),
        then keeps the newest `keep` checkpoints: positions here, dense state through Orbax,
        embedding snapshots through the store (with the groups their chains read)."""
        atomic_write_text(self.root / LAST_FILE, json.dumps({"step": int(step)}))
        self.prune()

    def prune(self) -> None:
        """Keeps the newest `keep` checkpoints and the best one: positions here, embedding
        snapshots through the store (process 0 only; the dense state: `prune_dense`)."""
        protected = {f"{step:010d}" for step in self.protected()}
        positions = sorted((self.root / "positions").glob("*"))
        for old in positions[: -self.keep] if self.keep > 0 else []:
            if old.name not in protected:
                shutil.rmtree(old, ignore_errors=True)
        store_checkpoint.prune(self.embeddings_url, self.keep, protect=self.protected())

    def read_position(self, step: int, process_index: int, process_count: int) -> dict[str, Any]:
        """Reads the dict `save_position` wrote for `step` and `process_index`.

        A checkpoint written by a job with a different number of processes has no position
        per process of this job: the record of its process 0 comes back (the run's counters
        are the same on every process) with `"processes"` = the writing job's count, and the
        source places each reader by the step alone (`ParquetReader.position_after`).

        Raises:
            UserError: the step has no positions, or this process's file is unreadable.
        """
        directory = self.root / "positions" / f"{step:010d}"
        written = sorted(directory.glob("process_*.json"))
        if not written:
            raise UserError(f"{directory}: no input positions for checkpoint step {step}")
        same_layout = len(written) == process_count
        path = directory / f"process_{process_index if same_layout else 0}.json"
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise UserError(f"{path}: unreadable input position ({error})") from None
        if not same_layout:
            record["processes"] = len(written)
        return record

    def restore_dense(self, step: int, like: Any) -> Any:
        """Restores the dense state of `step` with the shapes, dtypes and shardings of `like`
        (its device tables, if any, come back as they are in `like`)."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _dense(like))
        try:
            restored = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
            return (
                restored.replace(tables=like.tables) if getattr(like, "tables", None) else restored
            )
        except FileNotFoundError as error:
            raise UserError(
                f"{self.root / 'dense'}: no dense checkpoint at step {step}: {error}"
            ) from None

    def discard_after(self, step: int, *, chief: bool) -> None:
        """Removes every part newer than the complete `step` (a run killed mid-checkpoint).

        Call on every process (Orbax coordinates its deletes); files are removed by the chief.
        """
        for newer in [s for s in self.manager.all_steps() if s > step]:
            self.manager.delete(newer)
        if not chief:
            return
        for directory in (self.root / "positions").glob("*"):
            if directory.name.isdigit() and int(directory.name) > step:
                shutil.rmtree(directory, ignore_errors=True)
        store_checkpoint.discard_after(self.embeddings_url, step)

    def close(self) -> None:
        """Closes the Orbax manager if one was built; a later use builds a new one."""
        if self._manager is not None:
            self._manager.close()
            self._manager = None


def _dense(state: Any) -> Any:
    """The state without its device tables (`TrainState.tables`)."""
    return state.replace(tables={}) if getattr(state, "tables", None) else state
