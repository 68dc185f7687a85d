"""hybridrec from Python: the calls behind `hybridrec train` and `hybridrec evaluate`,
re-exported from the package root.

    import hybridrec

    config = hybridrec.load_config("sasrec", ["model.sequence.max_length=50"])
    summary = hybridrec.train(config, data="runs/events/data", run_dir="runs/sasrec")
    test = hybridrec.evaluate("runs/sasrec", split="test")
    hybridrec.export("runs/sasrec", "exports/sasrec")        # serving.export.export_run

They return instead of exiting: a bad config or bad data raises `UserError` with the
command line's one-line message; progress goes to stderr as in the CLI (`quiet=True`:
none).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from hybridrec.training import evaluate as evaluate_lib
from hybridrec.training.config import TrainConfig
from hybridrec.training.trainer import Trainer


def make_trainer(
    config: TrainConfig,
    *,
    run_dir: str | Path,
    data: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
    distributed: dict[str, Any] | None = None,
    tower: type | None = None,
    servers: Any = None,
) -> Trainer:
    """The `Trainer` that `train` runs, for a caller that needs it before it runs (`hybridrec
    train` installs its signal handlers by the job's process count). `servers`: embedding
    servers as the command line resolved them (default: `embedding.servers`)."""
    if tower is not None:
        model = dataclasses.replace(config.model, tower=f"{tower.__module__}:{tower.__qualname__}")
        config = dataclasses.replace(config, model=model)
    if data is not None:
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, path=str(data)))
    return Trainer(
        config,
        run_dir,
        resume=resume,
        overwrite=overwrite,
        quiet=quiet,
        distributed=distributed,
        servers=servers,
    )


def train(
    config: TrainConfig,
    *,
    run_dir: str | Path,
    data: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
    distributed: dict[str, Any] | None = None,
    stop: Any = None,
    tower: type | None = None,
) -> dict[str, Any]:
    """Trains `config` (on `data`, else `config.data.path`) into `run_dir`; returns the run's
    summary (also in `run_dir/summary.json`). `stop`: a threading.Event that ends the run
    after its current step, with a checkpoint. `tower`: a user's tower class (the tower
    contract, model/custom.py), saved in the run's config as its import path, so that
    `evaluate`, `export` and `--resume` find it where this process did."""
    trainer = make_trainer(
        config,
        run_dir=run_dir,
        data=data,
        resume=resume,
        overwrite=overwrite,
        quiet=quiet,
        distributed=distributed,
        tower=tower,
    )
    if trainer.is_chief and not quiet:
        for choice in trainer.job.choices:
            print(choice, file=sys.stderr, flush=True)
    return trainer.fit(stop)


def evaluate(
    run: str | Path,
    *,
    split: str | None = None,
    step: int | str | None = None,
    data: str | Path | None = None,
    quiet: bool = True,
) -> dict[str, Any]:
    """A run's checkpoint (the best it kept, else the newest complete one; or `step`: a
    number, "best", "latest") on a split (the run's eval split, or `split`): AUC, logloss,
    NE and calibration for click logs, HR@K / NDCG@K / MRR by full ranking for user
    histories; also written under `run/eval/`."""
    return evaluate_lib.evaluate_checkpoint(run, step=step, split=split, data=data, quiet=quiet)
