"""Evaluation: AUC, logloss, normalized entropy and calibration of a state on a split."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from hybridrec.common.errors import UserError
from hybridrec.pipeline import read_metadata
from hybridrec.pipeline.hashing import hash_scheme
from hybridrec.training.checkpoint import RunCheckpoints
from hybridrec.training.config import load_config
from hybridrec.training.job import Job
from hybridrec.training.run_dir import require_run_dir
from hybridrec.training.task import Evaluation
from hybridrec.training.tasks import prepare


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
    """Metrics of `state` with `store`'s embeddings on a split (default: the eval split),
    the same on every process; the task's (`Task.evaluate`). Lookups neither admit ids
    nor count them.

    Args:
        max_batches: evaluate at most this many batches (0 = the whole split).
        progress_name: show a progress line under this name (None = quiet).
    """
    covering = Evaluation(split or job.config.data.eval_split, max_batches, progress_name)
    return job.task.evaluate(job, state, store, eval_step, covering)


def describe(results: dict[str, Any]) -> str:
    """One line of an evaluation's headline metrics: ranking (HR, NDCG, MRR over queries)
    for a sequence run, else AUC, logloss, NE and calibration over rows."""
    if "queries" in results:  # a sequence run: retrieval and / or ranking
        parts = []
        if "hr@10" in results:
            parts.append(
                f"HR@10 {results['hr@10']:.4f}  NDCG@10 {results['ndcg@10']:.4f}  "
                f"HR@20 {results['hr@20']:.4f}  MRR {results['mrr']:.4f}"
            )
        if "auc" in results:
            parts.append(f"ranking AUC {results['auc']:.4f}  NE {results['ne']:.4f} (action mean)")
        return "  ".join(parts) + f"  ({int(results['queries']):,} queries, full ranking)"
    return (
        f"AUC {results.get('auc', math.nan):.4f}  logloss {results.get('logloss', math.nan):.4f}  "
        f"NE {results.get('ne', math.nan):.4f}  calibration "
        f"{results.get('calibration', math.nan):.3f}  ({int(results.get('count', 0)):,} rows)"
    )


def evaluate_checkpoint(
    run_dir: str | Path,
    *,
    step: int | None = None,
    split: str | None = None,
    data: str | Path | None = None,
    overrides: list[str] = (),
    distributed: dict[str, Any] | None = None,
    quiet: bool = True,
) -> dict[str, Any]:
    """Evaluates the checkpoint of `run_dir` at `step` (default: the best the run kept,
    else the newest complete one; `step_reason` in the result says which).

    Args:
        data: a preprocessed directory to evaluate on instead of the run's own data; its
            features must be those the run was trained on (names, order, kinds, tables,
            dense columns and id hashing), else a UserError names the difference.

    The result is also written to `run_dir/eval/step_<step>_<split>.json` (key `output`),
    or for another dataset to `step_<step>_<split>_on_<dataset name>-<path digest>.json`,
    so that it does not replace the run's own; `data` records the dataset evaluated.
    """
    run_dir = Path(run_dir)
    require_run_dir(run_dir)
    trained = load_config(None, [], run_dir)
    if data is not None:
        overrides = [*overrides, f"data.path={json.dumps(str(data))}"]
    config = load_config(None, list(overrides), run_dir)
    dataset = Path(config.data.path).resolve() if config.data.path else None
    own_data = dataset == Path(trained.data.path).resolve()
    if dataset is not None and not own_data:
        check_same_features(trained.data.path, config.data.path, run_dir)
    job = prepare(config, distributed=distributed)
    checkpoints = RunCheckpoints(
        run_dir, keep=job.config.checkpoint.keep, keep_best=job.config.checkpoint.keep_best
    )
    try:
        step, why = checkpoints.choose_step(step, "evaluate")
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
    finally:
        checkpoints.close()
    split = split or job.config.data.eval_split
    results = {"step": step, "step_reason": why, "split": split, "data": str(dataset), **results}
    if job.is_chief:
        name = f"step_{step:08d}_{split}"
        if not own_data:
            digest = hashlib.sha256(str(dataset).encode()).hexdigest()[:8]
            name += f"_on_{dataset.name or 'data'}-{digest}"
        out = run_dir / "eval" / f"{name}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")
        results["output"] = str(out)
    return results


def check_same_features(trained_on: str | Path, data: str | Path, run_dir: str | Path) -> None:
    """Raises a one-line UserError unless the dataset `data` has the features of `trained_on`.

    A model reads a row through its features: their order (an id's high bits hold its
    feature's position), kind (one id or a bag), table, separator, the dense columns with
    their parsing and transform, and the id hashing. The rest of a spec (the raw layout,
    the label's spelling) and the statistics may differ.
    """
    other = read_metadata(data)
    try:
        trained = read_metadata(trained_on)
    except UserError as error:
        raise UserError(
            f"--data {data}: cannot compare its features with those {run_dir} was trained "
            f"on: {error}"
        ) from None
    difference = _feature_difference(trained.raw, other.raw)
    if difference:
        raise UserError(
            f"--data {data}: not the features {run_dir} was trained on ({trained_on}): {difference}"
        )


def _feature_difference(trained: dict, other: dict) -> str | None:
    """What differs between two metadata.json's features, in a phrase naming the other
    dataset's value first, or None."""
    spec, other_spec = trained["spec"], other["spec"]
    features = {c["name"]: c for c in spec["categorical"]}
    theirs = {c["name"]: c for c in other_spec["categorical"]}
    if missing := [name for name in features if name not in theirs]:
        return f"it lacks categorical feature(s) {', '.join(missing)}"
    if extra := [name for name in theirs if name not in features]:
        return f"it has categorical feature(s) {', '.join(extra)} the run's data has not"
    if list(theirs) != list(features):
        return (
            f"its categorical features are in the order {', '.join(theirs)}, the run's in "
            f"{', '.join(features)} (an id carries its feature's position)"
        )
    for name, feature in features.items():
        kinds = [
            "multi-valued" if f["multi_valued"] else "single-valued"
            for f in (theirs[name], feature)
        ]
        if kinds[0] != kinds[1]:
            return f"feature {name} is {kinds[0]}, in the run's data {kinds[1]}"
        for key in ("separator", "table"):
            if theirs[name].get(key, "") != feature.get(key, ""):
                return (
                    f"feature {name} has {key} {theirs[name].get(key, '')!r}, in the run's "
                    f"data {feature.get(key, '')!r}"
                )
    for key in ("dense", "dense_type", "dense_transform"):
        if other_spec.get(key) != spec.get(key):
            return (
                f"{key} is {_shown(other_spec.get(key))}, in the run's data {_shown(spec.get(key))}"
            )
    schemes = [
        raw.get("hash_scheme") or hash_scheme(int(raw["spec"].get("prefix_bits", 8)))
        for raw in (other, trained)
    ]
    if schemes[0] != schemes[1]:
        return (
            f"its ids are hashed with {_scheme(schemes[0])}, the run's with {_scheme(schemes[1])}"
        )
    return None


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(value) or "none"
    return repr(value)


def _scheme(scheme: dict) -> str:
    return (
        f"{scheme.get('name')} v{scheme.get('version')} ({scheme.get('prefix_bits')} prefix bits)"
    )
