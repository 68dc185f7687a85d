"""A run directory: what `hybridrec train` writes there, the check that one holds a run,
and `--overwrite`'s removal of one (never of anything else)."""

from __future__ import annotations

import shutil
from pathlib import Path

from hybridrec.common.errors import UserError
from hybridrec.training.checkpoint import CONFIG_FILE

# what a directory `hybridrec train` wrote holds (any one of them marks it)
RUN_MARKERS = (CONFIG_FILE, "checkpoints", "metrics.jsonl", "summary.json")
# everything it may hold: the trainer's files, evaluate's and plot's, a profile, a
# multi-process job's per-process summaries, --follow's exports, the Slurm job's servers
RUN_ENTRIES = {
    *RUN_MARKERS,
    *("tensorboard", "eval", "plots", "profile", "processes", "export", "servers"),
}


def clear_run_dir(run_dir: Path, data: str | None) -> None:
    """`--overwrite`: removes `run_dir` when it holds a run and nothing else (or nothing).
    Refuses, deleting nothing, a directory that holds anything else, the dataset `data`
    or the working directory (the trainer has refused a file already)."""
    if not run_dir.exists():
        return
    resolved = run_dir.resolve()
    if data and Path(data).resolve().is_relative_to(resolved):
        raise UserError(
            f"--overwrite would delete {run_dir} and the dataset {data} inside it; "
            "give the run its own directory"
        )
    if Path.cwd().resolve().is_relative_to(resolved):
        raise UserError(
            f"--overwrite would delete {run_dir}, the working directory or one above it; "
            "give the run its own directory"
        )
    entries = sorted(entry.name for entry in run_dir.iterdir())
    if not entries:
        return
    others = [name for name in entries if name not in RUN_ENTRIES]
    if others or not any((run_dir / marker).exists() for marker in RUN_MARKERS):
        shown = others or entries
        listed = ", ".join(shown[:5]) + (", ..." if len(shown) > 5 else "")
        raise UserError(
            f"--overwrite: {run_dir} holds {listed}, which no run writes; not deleting it "
            "(delete it yourself, or give the run its own directory)"
        )
    shutil.rmtree(run_dir)


def require_run_dir(run_dir: Path) -> None:
    """Raises a UserError naming the command that makes one unless `run_dir` holds a run."""
    if not (run_dir / CONFIG_FILE).exists():
        what = (
            "does not exist"
            if not run_dir.exists()
            else f"is not a run directory (no {CONFIG_FILE})"
        )
        raise UserError(
            f"{run_dir} {what}; train one with `hybridrec train --data DATA_DIR --run-dir {run_dir}`"
        )
