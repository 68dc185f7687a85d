"""What `hybridrec train` does to its run directory: --overwrite deletes a run only once
the config and the data are checked, and nothing else; --resume of a finished run
changes nothing; the data path is saved absolute; a dataset without an eval split
trains without evaluation."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = ["--set", "data.max_steps=4"]


def run(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    """`hybridrec *args`, whatever its exit code."""
    return subprocess.run(
        [sys.executable, "-m", "hybridrec", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def one_line_error(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, dataset, training, small_model) -> Path:
    """A run of 4 steps, trained to its end, with the data path given relative."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    relative = os.path.relpath(dataset, REPO_ROOT)
    result = run(*training.args(Path(relative), run_dir, "--quiet", *small_model(), *STEPS))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def test_overwrite_deletes_nothing_before_the_config_and_data_are_checked(
    finished, dataset, tmp_path, training, small_model
):
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy)
    before = _snapshot(copy)
    data_before = _snapshot(dataset)
    args = ["--quiet", "--overwrite", *small_model(), *STEPS]
    typo = run(*training.args(dataset, copy, *args, "--set", "data.max_stepz=5"))
    assert "data.max_stepz" in one_line_error(typo)
    missing = run(*training.args(tmp_path / "no_data", copy, *args))
    assert "no_data" in one_line_error(missing)
    assert _snapshot(copy) == before
    # a directory that holds no run, and the dataset itself, are never deleted
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    refused = one_line_error(run(*training.args(dataset, notes, *args)))
    assert "which no run writes" in refused and "notes.txt" in refused
    assert (notes / "notes.txt").read_text() == "mine"
    # a run's own files beside another's (a config.json of something else, a model file)
    shutil.copy(finished / "config.json", notes / "config.json")
    refused = one_line_error(run(*training.args(dataset, notes, *args)))
    assert "notes.txt" in refused and "config.json" not in refused.split("holds")[1]
    assert (notes / "notes.txt").read_text() == "mine"
    # the working directory itself
    refused = one_line_error(run(*training.args(dataset, Path("."), *args), cwd=copy))
    assert "the working directory" in refused
    inside = one_line_error(run(*training.args(dataset, dataset, *args)))
    assert "the dataset" in inside
    assert _snapshot(dataset) == data_before
    # a file as the run directory, with or without --overwrite
    file = tmp_path / "file.txt"
    file.write_text("x")
    for extra in ([], ["--overwrite"]):
        result = run(*training.args(dataset, file, "--quiet", *extra, *small_model(), *STEPS))
        assert "a file, not a directory" in one_line_error(result)
    assert file.read_text() == "x"
    # a good config: the old run is replaced by a new one of 2 steps
    again = run(*training.args(dataset, copy, *args, "--set", "data.max_steps=2"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((copy / "summary.json").read_text())["steps"] == 2


def test_resume_of_a_finished_run_changes_nothing(finished, tmp_path):
    before = _snapshot(finished)
    error = one_line_error(run("train", "--run-dir", str(finished), "--resume", "--quiet"))
    assert "already finished" in error and "step 4" in error and "data.epochs" in error
    assert _snapshot(finished) == before
    # stopped after its last checkpoint, before its summary: --resume evaluates and writes it
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy)
    (copy / "summary.json").unlink()
    result = run("train", "--run-dir", str(copy), "--resume", "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((copy / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["eval"]["auc"] > 0


def test_the_data_path_is_saved_absolute(finished, dataset, tmp_path):
    saved = json.loads((finished / "config.json").read_text())["data"]["path"]
    assert saved == str(dataset.resolve())
    # so another working directory finds the data
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = run("evaluate", "--run", str(finished), "--json", cwd=elsewhere)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["count"] > 0


def test_a_dataset_without_an_eval_split_trains_without_evaluation(
    tmp_path, cli, training, small_model
):
    raw = tmp_path / "raw.tsv"
    cli("generate", "--output", str(raw), "--rows", "3000", "--seed", "2")
    data = tmp_path / "data"
    cli("preprocess", "--input", str(raw), "--output", str(data), "--eval-fraction", "0")
    result = cli(*training.args(data, tmp_path / "run", *small_model(), *STEPS))
    assert "evaluation: none: split 'eval'" in result.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["eval"] == {}


def test_sigterm_stops_after_a_step_with_a_checkpoint_to_resume_from(
    dataset, tmp_path, training, small_model
):
    """SIGTERM (a scheduler's preemption, Ctrl-C alike): the run ends after its current
    step with a checkpoint there and says how to continue; --resume finishes it."""
    run_dir = tmp_path / "run"
    args = training.args(dataset, run_dir, *small_model("data.max_steps=100000"))
    args += ["--set", "data.epochs=100", "--set", "checkpoint.every_steps=5"]
    process = training.start(*args, stdout=subprocess.PIPE)
    training.wait_for_checkpoint(process, run_dir, 5)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]  # not finished: restart me
    assert "SIGTERM: stopping after this step" in err
    stopped = training.last_step(run_dir)
    assert stopped >= 5 and json.loads((run_dir / "summary.json").read_text())["steps"] == stopped
    assert f"stopped at step {stopped} of 100000; continue with `hybridrec train --resume" in out
    finish = ["--set", f"data.max_steps={stopped + 3}"]
    result = run("train", "--run-dir", str(run_dir), "--resume", "--quiet", *finish)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == stopped + 3
