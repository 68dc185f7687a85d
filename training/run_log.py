"""A run's metrics: one JSON line per record in `metrics.jsonl`, mirrored to TensorBoard.

Records are `{"kind": "train" | "eval", "step": int, "time": unix seconds, ...}`.
Only process 0 of a job writes (`enabled=False` elsewhere). A resumed run first drops
the records past the step it resumes from, so the file reads as one clean history.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def run_name(run_dir: str | Path) -> str:
    """The name a run goes by in titles and summaries: its directory's name (`runs/avazu`
    -> "avazu"; `.` -> the current directory's name)."""
    return Path(run_dir).resolve().name or str(Path(run_dir).resolve())


def read_records(run_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Yields the records of `run_dir/metrics.jsonl`, skipping a torn last line."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return
    with path.open() as handle:
        for line in handle:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a killed process


class RunLog:
    """Appends metric records to JSONL and TensorBoard event files.

    Args:
        run_dir: the run directory.
        enabled: False on every process but 0 (then every call is a no-op).
        tensorboard: also write TensorBoard event files under run_dir/tensorboard.
        resume_step: drop existing records with a larger step (a resumed run).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool = True,
        tensorboard: bool = True,
        resume_step: int | None = None,
    ):
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS_FILE
        self._writer = None
        self._handle = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_records(run_dir) if r.get("step", 0) <= resume_step]
            temporary = self.path.with_suffix(".tmp")
            temporary.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(temporary, self.path)
        elif resume_step is None and self.path.exists():
            self.path.unlink()  # a fresh run in an old directory starts a fresh history
        self._handle = self.path.open("a", buffering=1)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(str(Path(run_dir) / TENSORBOARD_DIR))

    def write(self, kind: str, step: int, **values: Any) -> None:
        """Writes one record; numeric values also go to TensorBoard as `kind/name`."""
        if not self.enabled:
            return
        record = {"kind": kind, "step": int(step), "time": round(time.time(), 3), **values}
        self._handle.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for name, value in values.items():
                if isinstance(value, int | float) and math.isfinite(value):
                    self._writer.add_scalar(f"{kind}/{name}", value, step)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
