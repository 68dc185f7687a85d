"""Shared data for the trainer tests: one generated + preprocessed dataset per session."""

from __future__ import annotations

import os
import subprocess
import sys
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
]


def hybridrec(
    *args: str, env: dict | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Runs the real `hybridrec` command line in a subprocess; fails the test on error."""
    result = subprocess.run(
        [sys.executable, "-m", "hybridrec", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        pytest.fail(
            f"hybridrec {' '.join(args)} exited {result.returncode}\n"
            f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"
        )
    return result


def overrides(*extra: str) -> list[str]:
    """`--set` arguments for the small model plus `extra` keys."""
    return [item for key in (*SMALL_MODEL, *extra) for item in ("--set", key)]


@pytest.fixture(scope="session")
def cli():
    """The `hybridrec(*args)` subprocess runner."""
    return hybridrec


@pytest.fixture(scope="session")
def small_model():
    """`overrides(*extra)`: --set arguments of the small test model."""
    return overrides


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    """generate -> preprocess through the CLI: a preprocessed directory with train and eval."""
    root = tmp_path_factory.mktemp("trainer_data")
    raw = root / "raw.tsv"
    hybridrec("generate", "--output", str(raw), "--rows", str(ROWS), "--seed", "5")
    out = root / "data"
    hybridrec("preprocess", "--input", str(raw), "--output", str(out))
    return out
