"""`hybridrec plot RUN_DIR`: PNG training curves from a run's metrics.jsonl.

Writes `RUN_DIR/plots/curves.png`: training loss, eval AUC, samples/s and measured
staleness (mean and max per log interval, with the configured bound); for a run that
followed an event stream also `RUN_DIR/plots/windows.png`, each window's metrics as
evaluated before training on it.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridrec.common.errors import UserError
from hybridrec.training.run_log import read_records, run_name


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """Draws the curves of `run_dir`; returns the PNGs written (the curves, and an event
    stream run's windows, `plot_windows`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(
            f"run directory {run_dir} does not exist; `hybridrec train --data DATA_DIR "
            f"--run-dir {run_dir}` makes one"
        )
    records = list(read_records(run_dir))
    windows = plot_windows(run_dir, records)
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train:
        raise UserError(
            f"{run_dir}: no training records in metrics.jsonl to plot (is it a directory written "
            "by `hybridrec train`? records come every log.every_steps steps)"
        )
    bound = None
    config_path = run_dir / "config.json"
    if config_path.exists():
        bound = json.loads(config_path.read_text()).get("hybrid", {}).get("staleness")

    figure, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    steps = [r["step"] for r in train]
    loss_axis, auc_axis, speed_axis, stale_axis = axes.flat
    # a short run logs a few points: markers keep a single one visible
    marker = "o" if len(train) < 20 else None
    loss_axis.plot(steps, [r["loss"] for r in train], color="tab:blue", marker=marker)
    loss_axis.set(title="training loss (mean per log interval)", xlabel="step", ylabel="logloss")
    if evals:
        auc_axis.plot(
            [r["step"] for r in evals], [r.get("auc") for r in evals], "o-", color="tab:green"
        )
    auc_axis.set(title="eval AUC", xlabel="step", ylabel="AUC")
    speed_axis.plot(steps, [r["samples_per_s"] for r in train], color="tab:orange", marker=marker)
    speed_axis.set(title="throughput", xlabel="step", ylabel="samples/s")
    speed_axis.set_ylim(bottom=0)
    stale_axis.plot(
        steps, [r["staleness_mean"] for r in train], label="mean", color="tab:purple", marker=marker
    )
    stale_axis.plot(
        steps,
        [r["staleness_max"] for r in train],
        label="max",
        color="tab:red",
        alpha=0.7,
        marker=marker,
    )
    if bound is not None:
        stale_axis.axhline(bound, color="gray", linestyle="--", label=f"bound k={bound}")
    stale_axis.set(title="embedding staleness at lookup", xlabel="step", ylabel="pending updates")
    stale_axis.set_ylim(bottom=-0.1, top=max(1, (bound or 0) + 0.5))
    stale_axis.legend(loc="lower right")
    figure.suptitle(f"{run_name(run_dir)}: training curves")
    out = Path(out) if out else run_dir / "plots" / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return [out] if windows is None else [out, windows]


def plot_windows(run_dir: Path, records: list[dict]) -> Path | None:
    """An event stream run's windows (each file evaluated before it was trained on):
    HR@10 and NDCG@10 (AUC for ranking) per window, in `RUN_DIR/plots/windows.png`; None
    for runs without windows. A window evaluated twice (a resumed run) shows its last."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    windows = {r["window"]: r for r in records if r.get("kind") == "window"}
    if not windows:
        return None
    order = sorted(windows)
    metrics = [k for k in ("hr@10", "ndcg@10", "auc") if any(k in windows[w] for w in order)]
    figure, axis = plt.subplots(figsize=(8, 4), constrained_layout=True)
    marker = "o" if len(order) < 40 else None
    for name in metrics:
        axis.plot(order, [windows[w].get(name) for w in order], marker=marker, label=name)
    axis.set(
        title=f"{run_name(run_dir)}: each window evaluated before training on it",
        xlabel="window (stream shard)",
        ylabel="metric",
    )
    axis.set_ylim(bottom=0)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.legend(loc="upper left")
    out = run_dir / "plots" / "windows.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out
