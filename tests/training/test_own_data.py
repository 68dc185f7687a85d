"""A new user's own data: messages about the data directory, a schema unlike Criteo's
trained, evaluated and plotted with the defaults (no --set)."""

from __future__ import annotations

import os
import subprocess
import sys

from pipeline.metadata import SUCCESS_FILE

from .conftest import REPO_ROOT


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hybridrec", *args],
        cwd=REPO_ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_train_on_a_missing_directory_names_the_command_that_makes_one(tmp_path):
    missing = tmp_path / "nowhere"
    result = _run("train", "--data", str(missing), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert f"dataset directory {missing} does not exist" in result.stderr
    assert f"hybridrec preprocess --input RAW_FILES --spec SPEC --output {missing}" in result.stderr
    assert "Traceback" not in result.stderr


def test_train_on_an_incomplete_directory_says_how_to_finish_it(tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "part-00000.parquet").write_bytes(b"")
    result = _run("train", "--data", str(partial), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert f"incomplete dataset directory {partial}: no {SUCCESS_FILE} marker" in result.stderr
    assert f"--output {partial}` again" in result.stderr
    assert not (partial / SUCCESS_FILE).exists()
