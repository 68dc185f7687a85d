"""Evaluation: AUC, logloss, normalized entropy and calibration of a state on a split."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridrec.common.errors import UserError
from hybridrec.common.progress import Progress
from hybridrec.model import StreamingMetrics, local_rows
from hybridrec.training.checkpoint import RunCheckpoints
from hybridrec.training.job import Job, load_config, prepare, require_run_dir
from hybridrec.training.layouts import feature_ids


def evaluate(
    job: Job,
    state: Any,
    store: Any,
    eval_step: Any,
    *,
    split: str | None = None,
    max_batches: int = 0,
    progress_name: str | None = None,
) -> dict[str, float]:
    """Metrics of `state` with `store`'s embeddings on a split (every process returns them).

    Every process evaluates its own share of the files; predictions are gathered so
    every process returns the same numbers. Lookups neither admit ids nor count them.

    Args:
        max_batches: evaluate at most this many batches (0 = the whole split).
        progress_name: show a progress line under this name (None = quiet).
    """
    config = job.config
    batch_size = config.data.eval_batch_size or config.data.batch_size
    reader, rows = job.reader(split or config.data.eval_split, batch_size=batch_size, train=False)
    num_batches = reader.batches_per_epoch
    if max_batches:
        num_batches = min(num_batches, max_batches)
    metrics = StreamingMetrics()
    progress = Progress(progress_name, total=num_batches, unit="batches") if progress_name else None
    layout = job.layout(batch_size, rows)
    for batch in reader.batches(num_batches=num_batches):
        pooled = store.lookup_features(
            feature_ids(batch, layout.rows, layout.features),
            feature_tables=job.tables.feature_tables,
            pooling=config.embedding.pooling,
            train=False,
        ).result()
        out = eval_step(state, layout.device_batch(batch, pooled.embeddings))
        if job.tower_parallel:  # every process read the whole batch: compare in global order
            probabilities, labels, valid = job.global_rows(out), batch.labels, batch.valid
        else:
            probabilities, labels, valid = (
                job.gather(local_rows(out)),
                job.gather(batch.labels[rows]),
                job.gather(batch.valid[rows]),
            )
        metrics.update(probabilities[valid], labels[valid])
        if progress:
            progress.update(1)
    if progress:
        progress.close()
    return {key: float(value) for key, value in metrics.result().items()}


def evaluate_checkpoint(
    run_dir: str | Path,
    *,
    step: int | None = None,
    split: str | None = None,
    overrides: list[str] = (),
    distributed: dict[str, Any] | None = None,
    quiet: bool = True,
) -> dict[str, Any]:
    """Evaluates the checkpoint of `run_dir` at `step` (default: the newest complete one).

    The result is also written to `run_dir/eval/step_<step>_<split>.json` (key `output`).
    """
    run_dir = Path(run_dir)
    require_run_dir(run_dir)
    job = prepare(load_config(None, list(overrides), run_dir), distributed=distributed)
    checkpoints = RunCheckpoints(run_dir, keep=job.config.checkpoint.keep)
    step = step if step is not None else checkpoints.latest_step()
    if step is None:
        raise UserError(
            f"{run_dir}: no complete checkpoint to evaluate (training stopped before its first); "
            f"continue it with `hybridrec train --resume --run-dir {run_dir}`"
        )
    state = checkpoints.restore_dense(step, job.new_state())
    store = job.open_store(checkpoints, step, remote=False)
    try:
        results = evaluate(
            job,
            state,
            store,
            job.eval_step(),
            split=split,
            progress_name=None if quiet or not job.is_chief else "evaluate",
        )
    finally:
        store.close()
        checkpoints.close()
    results = {"step": step, "split": split or job.config.data.eval_split, **results}
    if job.is_chief:
        out = run_dir / "eval" / f"step_{step:08d}_{results['split']}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")
        results["output"] = str(out)
    return results
