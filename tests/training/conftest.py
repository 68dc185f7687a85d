"""Shared data for the trainer tests: one generated + preprocessed dataset per session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
ROWS = 40_000

# A tiny DLRM so each test compiles and trains in seconds; every test adds its own keys.
SMALL_MODEL = [
    "model.dlrm.bottom_mlp=[32, 8]",
    "model.dlrm.top_mlp=[64, 32]",
    "embedding.dim=8",
    "embedding.capacity=400000",
    "data.batch_size=256",
    "data.shuffle_buffer=8192",
    "optimizer.learning_rate=0.003",
    "optimizer.warmup_steps=0",
    "embedding.optimizer.learning_rate=0.05",
    "log.every_steps=5",
    "checkpoint.every_steps=0",
    "eval.every_steps=0",
    # every table in the host store: these tests measure the store and the hybrid loop
    # (tables on the devices: test_device_tables.py)
    "embedding.device_budget=0",
]


def overrides(*extra: str) -> list[str]:
    """`--set` arguments for the small model plus `extra` keys."""
    return [item for key in (*SMALL_MODEL, *extra) for item in ("--set", key)]


def train_args(dataset: Path, run_dir: Path, *extra: str) -> list[str]:
    """`train` arguments: the quickstart preset on `dataset`, writing `run_dir`, plus `extra`."""
    return [
        "train",
        "--data",
        str(dataset),
        "--run-dir",
        str(run_dir),
        "--config",
        "quickstart",
        *extra,
    ]


def start(*args: str, env: dict | None = None, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    """Starts `hybridrec *args` in the background; its stderr (text) explains a failure
    (`stdout=subprocess.PIPE` keeps its output too)."""
    return subprocess.Popen(
        [sys.executable, "-m", "hybridrec", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
    )


def last_checkpoint_step(run_dir: Path) -> int | None:
    """The step of the run's newest committed checkpoint (its LAST marker), if any."""
    try:
        return json.loads((run_dir / "checkpoints" / "LAST").read_text())["step"]
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def wait_for_checkpoint(
    process: subprocess.Popen, run_dir: Path, step: int, timeout: float = 180
) -> None:
    """Waits until `run_dir` commits a checkpoint at `step` or later; fails if `process` exits."""
    deadline = time.monotonic() + timeout
    while (last_checkpoint_step(run_dir) or 0) < step:
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, f"no checkpoint at step {step} within {timeout} s"
        time.sleep(0.05)


@pytest.fixture(scope="session")
def training():
    """Helpers for runs of `hybridrec train`: args, start, last_step, wait_for_checkpoint."""
    return types.SimpleNamespace(
        args=train_args,
        start=start,
        last_step=last_checkpoint_step,
        wait_for_checkpoint=wait_for_checkpoint,
    )


@pytest.fixture(scope="session")
def small_model():
    """`overrides(*extra)`: --set arguments of the small test model."""
    return overrides


@pytest.fixture(scope="session")
def dataset(tmp_path_factory, cli) -> Path:
    """generate -> preprocess through the CLI: a preprocessed directory with train and eval."""
    root = tmp_path_factory.mktemp("trainer_data")
    raw = root / "raw.tsv"
    cli("generate", "--output", str(raw), "--rows", str(ROWS), "--seed", "5")
    out = root / "data"
    cli("preprocess", "--input", str(raw), "--output", str(out))
    return out
