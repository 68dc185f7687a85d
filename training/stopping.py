"""Training that stops at its best: which figure a run keeps its best checkpoint by, how
often it evaluates, and when it stops (docs/training.md, "Training that stops at its best").

A run keeps its best checkpoint when it evaluates a validation split of its own: the one
it is tuned and stopped on, never the one its figures are reported on. Sequence runs always
have one (leave-one-out's second-to-last events, `valid`; test is read afterwards by
`hybridrec evaluate --split test`); a click-log run has one when its dataset has a `valid`
split besides `eval` (`hybridrec preprocess --valid-fraction`). For such a run the "auto"
values become:

| key (auto value)               | becomes |
|---|---|
| `checkpoint.keep_best` ("auto") | the task's metric: HR@10 (next-item retrieval), AUC (clicks, ranking) |
| `eval.every_steps` (-1)         | one epoch's steps within [AUTO_EVAL_MIN_STEPS, AUTO_EVAL_MAX_STEPS]; after the first evaluation, widened so that evaluating takes at most AUTO_EVAL_SHARE of the time |
| `train.patience` (-1)           | AUTO_PATIENCE evaluations without a better figure |

Every evaluation then checkpoints, the best is recorded (`checkpoints/BEST`), the run
stops after `train.patience` evaluations without a better one (`data.epochs` is the cap),
and `evaluate` / `export` read the best unless told `--step latest`. Without a validation
split of its own the auto values keep the earlier behaviour: no best, evaluation at the end.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from hybridrec.common.errors import UserError
from hybridrec.training.checkpoint import LOWER_IS_BETTER, RunCheckpoints
from hybridrec.training.config import TrainConfig
from hybridrec.training.defaults import choose_decay
from hybridrec.training.job import Job
from hybridrec.training.task import Task
from jax.experimental import multihost_utils

AUTO_PATIENCE = 5  # evaluations without a better figure before an "auto" run stops
# an "auto" interval is one epoch, but at least this many steps (a tiny dataset's epoch is
# a few steps: evaluating it would cost more than training) and at most this many (a large
# dataset's epoch can take hours)
AUTO_EVAL_MIN_STEPS = 200
AUTO_EVAL_MAX_STEPS = 5000
# ... and widened, once the first evaluation is measured, so that evaluating takes at most
# this share of the run's time
AUTO_EVAL_SHARE = 0.2
VALIDATION_SPLIT = "valid"  # a click-log dataset's validation split (besides "eval")


@dataclasses.dataclass(frozen=True)
class StopRule:
    """A run's resolved stopping: the metric its best is kept by ("" = none), the
    evaluation interval in steps (0 = at the end only), the patience (0 = never early),
    and whether `every` may still widen after the first evaluation (an auto interval)."""

    metric: str
    every: int
    patience: int
    adaptive: bool = False

    @property
    def lower_is_better(self) -> bool:
        return self.metric in LOWER_IS_BETTER


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What a run evaluates while it trains, and when it stops.

    rule: the stopping rule (`resolve`).
    split: the validation split it evaluates (None: its eval split, `data.eval_split`).
    evaluates: it evaluates at all (its eval or validation split has files).
    """

    rule: StopRule
    split: str | None
    evaluates: bool


def validation_split(job: Job) -> str | None:
    """The split a run tunes and stops on, when it has one of its own with files: a
    sequence run's eval split "valid" (leave-one-out; its figures are test's), a click-log
    run's "valid" beside the "eval" its figures are reported on."""
    split = job.task.validation_split(job.config)
    if split != VALIDATION_SPLIT or not job.metadata.has_split(split):
        return None
    return split if job.metadata.split_files(split) else None


def schedule_run(
    job: Job, *, evaluates: bool, steps_per_epoch: int, last_step: int | None, follow: bool
) -> tuple[Job, Schedule]:
    """The job with its evaluation, best checkpoint, patience and dense decay made
    concrete (and a start-up line for each), and its schedule.

    Args:
        evaluates: the source has an eval split with files.
        steps_per_epoch: batches in one epoch of the training split (0: a stream).
        last_step: the run's last step (None: a stream without end).
        follow: a followed stream.
    """
    split = None if follow else validation_split(job)
    evaluates = evaluates or split is not None  # a click log's valid split, evaluated
    choices = []
    if not follow and not evaluates:
        data = job.config.data
        choices.append(
            f"evaluation: none: split {data.eval_split!r} of {data.path} has no files "
            "(preprocess --eval-fraction > 0 makes one)"
        )
    config, rule, lines = resolve(
        job.config,
        task=job.task,
        validation=split is not None,
        steps_per_epoch=steps_per_epoch,
        follow=follow,
    )
    choices += lines
    optimizer, reason = choose_decay(config.optimizer, last_step, stops_early=rule.patience > 0)
    if reason:
        config = dataclasses.replace(config, optimizer=optimizer)
        choices.append(reason)
    job = dataclasses.replace(job, config=config, choices=(*job.choices, *choices))
    names = job.task.metric_names(job.config)
    if rule.metric and rule.metric not in names:
        shown = ", ".join(sorted(names))
        raise UserError(
            f"checkpoint.keep_best = {rule.metric!r} is not a metric of this run ({shown})"
        )
    return job, Schedule(rule, split, evaluates)


def check_not_stopped(checkpoints: RunCheckpoints, rule: StopRule, step: int, job: Job) -> None:
    """A UserError when the run resumed at `step` already stopped at its best."""
    saved = checkpoints.read_position(step, job.process_index, job.process_count).get("stopping")
    if Patience(rule, saved).exhausted:
        raise UserError(
            f"{checkpoints.root.parent} already stopped at step {step}: {saved['since']} "
            f"evaluations without a better {rule.metric} than at step {saved['best_step']}; "
            "raise train.patience (--set train.patience=N, 0 = to the cap) to train it further"
        )


def resolve(
    config: TrainConfig,
    *,
    task: Task,
    validation: bool,
    steps_per_epoch: int,
    follow: bool = False,
) -> tuple[TrainConfig, StopRule, tuple[str, ...]]:
    """The config with `checkpoint.keep_best`, `eval.every_steps` and `train.patience`
    made concrete for a run, the rule they make, and a start-up line for each auto value.

    Args:
        config: the run's config (its data split and sequence settings resolved).
        task: the run's task (the metric a best is kept by; why a patience cannot work).
        validation: the run evaluates a validation split of its own (see the module).
        steps_per_epoch: batches in one epoch of the training split.
        follow: a followed stream (no epochs, no stopping).

    Raises:
        UserError: a patience without a validation split, or without a best to wait for.
    """
    best, every, patience = (
        config.checkpoint.keep_best,
        config.eval.every_steps,
        config.train.patience,
    )
    lines = []
    keeps = validation and not follow
    if best == "auto":
        best = task.judged_by(config) if keeps else ""
        if best:
            lines.append(
                f"best checkpoint: checkpoint.keep_best = auto: by validation {best} on split "
                f"{config.data.eval_split!r}"
            )
    if patience > 0 and not keeps:
        raise UserError(_no_validation(config, task, follow))
    if patience > 0 and not best:
        raise UserError(
            f"train.patience = {patience} waits for a better checkpoint.keep_best figure, but "
            "checkpoint.keep_best is empty: name a metric (hr@10, auc, ...) or leave it auto"
        )
    if patience == -1:
        patience = AUTO_PATIENCE if best and keeps else 0
        if patience:
            lines.append(
                f"stopping: train.patience = auto: after {patience} evaluations without a better "
                f"{best} (data.epochs = {config.data.epochs} is the cap; 0 = train to the cap)"
            )
    adaptive = False
    if every == -1:
        if best and not follow:
            every = min(max(steps_per_epoch, AUTO_EVAL_MIN_STEPS), AUTO_EVAL_MAX_STEPS)
            adaptive = True
            lines.append(
                f"evaluation: eval.every_steps = auto: every {every:,} steps (an epoch is "
                f"{steps_per_epoch:,}; within [{AUTO_EVAL_MIN_STEPS:,}, {AUTO_EVAL_MAX_STEPS:,}]"
                f", widened if evaluating takes over {AUTO_EVAL_SHARE:.0%} of the time)"
            )
        else:
            every = 0
    resolved = dataclasses.replace(
        config,
        checkpoint=dataclasses.replace(config.checkpoint, keep_best=best),
        eval=dataclasses.replace(config.eval, every_steps=every),
        train=dataclasses.replace(config.train, patience=patience),
    )
    return resolved, StopRule(best, every, patience, adaptive), tuple(lines)


def _no_validation(config: TrainConfig, task: Task, follow: bool) -> str:
    if follow:
        return (
            f"train.patience = {config.train.patience}: a followed stream has no validation "
            "split to stop on (set train.patience = 0)"
        )
    return task.no_validation(config)


def widened_interval(every: int, train_seconds: float, eval_seconds: float) -> int:
    """The interval after the first evaluation: `every`, or a multiple of it when one
    evaluation (`eval_seconds`) takes more than AUTO_EVAL_SHARE of the time the interval
    trained for (`train_seconds`) and evaluated."""
    if train_seconds <= 0 or eval_seconds <= 0:
        return every
    share = eval_seconds / (eval_seconds + train_seconds)
    if share <= AUTO_EVAL_SHARE:
        return every
    factor = math.ceil(eval_seconds * (1 - AUTO_EVAL_SHARE) / (AUTO_EVAL_SHARE * train_seconds))
    return every * max(factor, 1)


class Patience:
    """The best figure so far and the evaluations since it, across a run and its resumes.

    Args:
        rule: the run's stopping rule.
        saved: what `record()` returned at the checkpoint the run resumes from, or None.
    """

    def __init__(self, rule: StopRule, saved: dict[str, Any] | None = None):
        self.rule = rule
        saved = saved or {}
        self.every = int(saved.get("every", rule.every))
        self.adaptive = bool(saved.get("adaptive", rule.adaptive))
        self.best_step: int | None = saved.get("best_step")
        self.best_value: float | None = saved.get("best_value")
        self.best_seconds: dict[str, float] = saved.get("best_seconds", {})
        self.since = int(saved.get("since", 0))
        self.stopped = ""

    def update(self, step: int, results: dict[str, Any], seconds: dict[str, float]) -> bool:
        """Counts the evaluation of `step`; True when its figure is the best so far.
        `seconds`: the run's training and wall seconds at the step."""
        if not self.rule.metric:
            return False
        value = float(results[self.rule.metric])
        better = self.best_value is None or (
            value < self.best_value if self.rule.lower_is_better else value > self.best_value
        )
        if better:
            self.best_step, self.best_value, self.since = int(step), value, 0
            self.best_seconds = {key: round(value, 3) for key, value in seconds.items()}
        else:
            self.since += 1
        if self.rule.patience and self.since >= self.rule.patience:
            self.stopped = (
                f"patience: {self.since} evaluations without a better {self.rule.metric} than "
                f"{self.best_value:.4f} at step {self.best_step} (train.patience = "
                f"{self.rule.patience})"
            )
        return better

    @property
    def exhausted(self) -> bool:
        """The run has waited `patience` evaluations for a better figure."""
        return bool(self.rule.patience) and self.since >= self.rule.patience

    def widen(self, train_seconds: float, eval_seconds: float, processes: int) -> str:
        """Fixes an auto interval after its first evaluation (`widened_interval`, on the
        chief's measurement for every process); returns a line saying so when it widened."""
        every = widened_interval(self.every, train_seconds, eval_seconds)
        if processes > 1:
            every = int(multihost_utils.broadcast_one_to_all(np.int64(every)))
        before, self.every, self.adaptive = self.every, every, False
        if every == before:
            return ""
        return (
            f"evaluating every {every:,} steps from now on: one evaluation took "
            f"{eval_seconds:.1f} s against {train_seconds:.1f} s of training in its {before:,} steps"
        )

    def record(self) -> dict[str, Any]:
        """What a checkpoint keeps of it (a resumed run goes on counting)."""
        return {
            "every": self.every,
            "adaptive": self.adaptive,
            "best_step": self.best_step,
            "best_value": self.best_value,
            "best_seconds": self.best_seconds,
            "since": self.since,
        }

    def summary(self, stopped_at_cap: bool) -> dict[str, Any]:
        """The summary's account: the best step, its figure, why the run stopped."""
        if not self.rule.metric:
            return {}
        if self.stopped:
            why = self.stopped
        elif stopped_at_cap:
            why = "cap: the run trained to its last step (data.epochs, data.max_steps)"
        else:
            why = "stopped before its end (interrupted)"
        return {
            "best": {
                "step": self.best_step,
                "metric": self.rule.metric,
                "value": self.best_value,
                **{f"{key}_to_best": value for key, value in self.best_seconds.items()},
            },
            "stopped": why,
            "eval_every_steps": self.every,
        }
