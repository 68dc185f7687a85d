"""`evaluate`, `export` and `serve` given the wrong thing: one line naming it, nothing
written where it does not belong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hybridrec.common.errors import UserError
from hybridrec.training.evaluate import check_same_features

REPO_ROOT = Path(__file__).resolve().parents[2]


def _fails(*args: str) -> str:
    """The one line `hybridrec *args` prints as it exits with status 2."""
    result = subprocess.run(
        [sys.executable, "-m", "hybridrec", *args],
        cwd=REPO_ROOT,
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def _copy_dataset(dataset: Path, out: Path, edit=None) -> Path:
    """A dataset sharing `dataset`'s Parquet files, its metadata.json changed by `edit`."""
    out.mkdir()
    for name in os.listdir(dataset):
        if name != "metadata.json":
            (out / name).symlink_to(dataset / name)
    metadata = json.loads((dataset / "metadata.json").read_text())
    if edit:
        edit(metadata)
    (out / "metadata.json").write_text(json.dumps(metadata))
    return out


@pytest.fixture(scope="module")
def run_dir(dataset, tmp_path_factory, cli, small_model, training) -> Path:
    """A run of 5 steps on `dataset`, checkpointed at its end."""
    run_dir = tmp_path_factory.mktemp("cli_errors") / "run"
    cli(*training.args(dataset, run_dir, *small_model("data.max_steps=5")))
    assert training.last_step(run_dir) == 5
    return run_dir


def test_evaluate_a_step_without_checkpoint_is_one_line(run_dir):
    line = _fails("evaluate", "--run", str(run_dir), "--step", "7")
    assert line.endswith(f"{run_dir}: no complete checkpoint at step 7 (complete steps: 5)")


def test_evaluate_other_data_keeps_the_runs_own_result(run_dir, dataset, tmp_path, cli):
    cli("evaluate", "--run", str(run_dir))
    own = run_dir / "eval" / "step_00000005_eval.json"
    before = own.read_text()
    other = _copy_dataset(dataset, tmp_path / "day2")
    result = json.loads(
        cli("evaluate", "--run", str(run_dir), "--data", str(other), "--json").stdout
    )
    assert own.read_text() == before
    written = Path(result["output"])
    assert written.parent == own.parent and written.name.startswith("step_00000005_eval_on_day2-")
    assert json.loads(written.read_text())["data"] == str(other.resolve())
    assert json.loads(before)["data"] == str(dataset.resolve())


def _multi_valued(metadata):
    feature = metadata["spec"]["categorical"][0]
    assert not feature["multi_valued"]
    feature.update(multi_valued=True, separator="|")


def _swapped(metadata):
    features = metadata["spec"]["categorical"]
    features[0], features[1] = features[1], features[0]


def _no_categorical(metadata):
    metadata["spec"]["categorical"] = []


def _other_table(metadata):
    metadata["spec"]["categorical"][0]["table"] = "elsewhere"


def _fewer_dense(metadata):
    metadata["spec"]["dense"] = metadata["spec"]["dense"][1:]


def _identity_transform(metadata):
    metadata["spec"]["dense_transform"] = "identity"


def _other_prefix_bits(metadata):
    metadata["hash_scheme"]["prefix_bits"] = 12
    metadata["spec"]["prefix_bits"] = 12


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_multi_valued, r"feature \w+ is multi-valued, in the run's data single-valued"),
        (_swapped, r"its categorical features are in the order"),
        (_no_categorical, r"it lacks categorical feature\(s\) \w+, "),
        (_other_table, r"feature \w+ has table 'elsewhere'"),
        (_fewer_dense, r"dense is .*, in the run's data "),
        (_identity_transform, r"dense_transform is 'identity', in the run's data 'log1p'"),
        (_other_prefix_bits, r"ids are hashed with \S+ v1 \(12 prefix bits\), the run's with"),
    ],
)
def test_data_of_other_features_is_refused(dataset, tmp_path, edit, message):
    other = _copy_dataset(dataset, tmp_path / "other", edit)
    with pytest.raises(UserError, match=message):
        check_same_features(dataset, other, "RUN")
    # the same features, whatever the statistics and raw layout
    same = _copy_dataset(dataset, tmp_path / "same", lambda m: m.update(stats={}))
    check_same_features(dataset, same, "RUN")


def test_evaluate_refuses_data_of_other_features_in_one_line(run_dir, dataset, tmp_path):
    own = run_dir / "eval"
    written = sorted(own.iterdir()) if own.exists() else []
    for edit in (_multi_valued, _no_categorical):
        other = _copy_dataset(dataset, tmp_path / edit.__name__, edit)
        line = _fails("evaluate", "--run", str(run_dir), "--data", str(other))
        assert f"--data {other}: not the features {run_dir} was trained on" in line
    assert (sorted(own.iterdir()) if own.exists() else []) == written


def test_export_into_a_file_run_or_dataset_is_refused(run_dir, dataset, tmp_path):
    file = tmp_path / "clicks.tsv"
    file.write_text("not a directory\n")
    cases = [
        (file, "is a file"),
        (file / "sub", "is a file, not a directory"),
        (run_dir, "is a run directory (it holds config.json, checkpoints, "),
        (dataset, "is a dataset directory (it holds metadata.json, _SUCCESS)"),
    ]
    before = {path: sorted(os.listdir(path)) for path in (run_dir, dataset)}
    for out, message in cases:
        line = _fails("export", "--run", str(run_dir), "--out", str(out))
        assert f"--out {out}" in line and message in line, line
    assert {path: sorted(os.listdir(path)) for path in before} == before


def test_serve_port_out_of_range_is_one_line():
    for port in ("99999", "-1"):
        assert _fails("serve", "no-such-export", "--port", port).endswith(
            f"--port {port} is outside 0-65535 (0: any free port)"
        )


def test_serve_a_run_directory_suggests_an_export_directory_of_its_own(run_dir):
    line = _fails("serve", str(run_dir))
    suggested = f"hybridrec export --run {run_dir} --out exports/{run_dir.name}`"
    assert "is a run directory" in line and suggested in line, line
    assert f"--out {run_dir}`" not in line
