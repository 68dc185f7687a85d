"""A new user's own data: messages about the data directory, a schema unlike Criteo's
trained, evaluated and plotted with the defaults (no --set)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
from hybridrec.pipeline import BlockParser, ParquetParser, load_spec
from hybridrec.pipeline.metadata import SUCCESS_FILE

from .conftest import REPO_ROOT


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hybridrec", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
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


# A click log unlike Criteo's: comma separated with a header, an id and a timestamp that are
# not features, a string label, five categorical fields and no numeric ones.
OWN_COLUMNS = ["row_id", "event_time", "outcome", "site", "app", "device", "slot", "campaign"]
OWN_CARDINALITIES = [300, 120, 40, 8, 2000]
OWN_ROWS = 40_000

OWN_SPEC = """\
name = "own_clicks"
delimiter = ","
header = true
columns = ["row_id", "event_time", "outcome", "site", "app", "device", "slot", "campaign"]
label = "outcome"
label_values = ["noclick", "click"]
""" + "".join(
    f'\n[[categorical]]\nname = "{name}"\n'
    for name in ("site", "app", "device", "slot", "campaign")
)


def write_own_log(path: Path, rows: int = OWN_ROWS, seed: int = 3) -> None:
    """A raw log of OWN_COLUMNS whose label depends on per-value effects of the fields."""
    rng = np.random.default_rng(seed)
    logits = np.full(rows, -1.0)
    fields = []
    for index, cardinality in enumerate(OWN_CARDINALITIES):
        values = np.minimum(rng.zipf(1.3, rows) - 1, cardinality - 1)
        logits += rng.normal(0.0, 0.8, cardinality)[values]
        fields.append([f"{'abcde'[index]}{value:x}" for value in values])
    labels = rng.random(rows) < 1 / (1 + np.exp(-logits))
    lines = [",".join(OWN_COLUMNS)]
    for row in range(rows):
        outcome = "click" if labels[row] else "noclick"
        time = f"2026-01-{1 + row * 28 // rows:02d}T{row % 24:02d}:00:00"
        lines.append(",".join([f"r{row:07d}", time, outcome, *(f[row] for f in fields)]))
    path.write_text("\n".join(lines) + "\n")


def test_parser_maps_string_labels_and_names_other_values(tmp_path):
    (tmp_path / "own.toml").write_text(OWN_SPEC)
    parser = BlockParser(load_spec(tmp_path / "own.toml"))
    block = b"r1,t,click,a,b,c,d,e\nr2,t,noclick,a,b,c,d,e\nr3,t,1,a,b,c,d,e\n"
    parsed = parser.parse(block)
    assert parsed.table.column("outcome").to_pylist() == [1.0, 0.0]
    [(line, reason, detail, _)] = parsed.rejected
    assert (line, reason) == (2, "bad_label")
    assert detail == "label '1' is not noclick or click"


def test_parquet_input_maps_string_labels_like_text(tmp_path):
    (tmp_path / "own.toml").write_text(OWN_SPEC)
    spec = load_spec(tmp_path / "own.toml")
    rows = [["r1", "t", "click"], ["r2", "t", "noclick"], ["r3", "t", "1"]]
    columns = {name: [row[i] for row in rows] for i, name in enumerate(OWN_COLUMNS[:3])}
    columns.update({name: ["a", "b", "c"] for name in OWN_COLUMNS[3:]})
    parsed = ParquetParser(spec).parse(pa.RecordBatch.from_pydict(columns))
    assert parsed.table.column("outcome").to_pylist() == [1.0, 0.0]
    [(line, reason, detail, _)] = parsed.rejected
    assert (line, reason, detail) == (2, "bad_label", "label '1' is not noclick or click")


def test_own_schema_trains_evaluates_and_plots_with_the_defaults(tmp_path, cli):
    raw, spec, data = tmp_path / "clicks.csv", tmp_path / "own.toml", tmp_path / "data"
    write_own_log(raw)
    spec.write_text(OWN_SPEC)
    cli("preprocess", "--input", str(raw), "--spec", str(spec), "--output", str(data))
    run_dir = tmp_path / "own_run"
    train = cli("train", "--data", str(data), "--run-dir", str(run_dir))  # no preset, no --set
    assert "tower: model.tower = 'auto': dcnv2, the data has no numeric features" in train.stdout
    assert "batch: data.batch_size = 0 (auto): 256" in train.stdout
    assert "training finished: own_run" in train.stdout
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["model"]["tower"] == "dcnv2" and saved["data"]["batch_size"] == 256
    steps = json.loads((run_dir / "summary.json").read_text())["steps"]
    assert f"cosine from 0.001 to 0 over the run's {steps:,} steps" in train.stdout
    assert saved["optimizer"]["decay"] == "auto"  # a resumed run decays to its own end

    evaluated = cli("evaluate", "--run", str(run_dir))
    assert evaluated.stdout.startswith("own_run step ")
    auc = float(evaluated.stdout.split("AUC ")[1].split()[0])
    assert auc > 0.65, evaluated.stdout

    plotted = cli("plot", str(run_dir))
    assert plotted.stdout.startswith("own_run: wrote ")
    assert (run_dir / "plots" / "curves.png").stat().st_size > 10_000


def test_launch_relays_output_without_library_chatter_unless_verbose():
    from hybridrec.cli.launch import _relay

    lines = "step 5\n[Gloo] Rank 0 is connected to 1 peer ranks.\ndone\n"
    quiet, verbose = io.StringIO(), io.StringIO()
    _relay(io.StringIO(lines), "[p1] ", quiet)
    _relay(io.StringIO(lines), "", verbose, verbose=True)
    assert quiet.getvalue() == "[p1] step 5\n[p1] done\n"
    assert verbose.getvalue() == lines
    # Gloo's threads write at the same time: their lines come interleaved mid-line
    mixed = "step 5\n[Gloo] Rank 0 is con[Gloo] Rank 1 is connected to 1 peer ranks.\nnected to 1 peer ranks.\ndone\n"
    quiet = io.StringIO()
    _relay(io.StringIO(mixed), "", quiet)
    assert quiet.getvalue() == "step 5\ndone\n"


def test_launch_gives_each_process_its_own_gpus_and_refuses_too_few(monkeypatch):
    from hybridrec.cli.launch import host_gpus, process_environment

    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    gpus = host_gpus(dict(os.environ), "cuda")
    assert gpus == ["3", "5", "6", "7"]
    seen = [process_environment(i, 2, "127.0.0.1:1", 2, gpus) for i in range(2)]
    assert [env["CUDA_VISIBLE_DEVICES"] for env in seen] == ["3,5", "6,7"]
    assert all(env["JAX_PLATFORMS"] == "cuda" for env in seen)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # CPU devices: the GPUs are not split
    assert process_environment(1, 2, "127.0.0.1:1", 2, gpus)["CUDA_VISIBLE_DEVICES"] == "3,5,6,7"
    # more GPUs asked for than the host shows: one line, nothing started
    env = {"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "0,1,2"}
    result = _run("launch", "-n", "2", "--devices-per-process", "2", "--", "train", env=env)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "2 processes x 2 devices need 4 GPUs, and JAX_PLATFORMS=cuda on this host sees 3" in (
        result.stderr
    )


FAKE_NVIDIA_SMI = """#!/bin/sh
echo called >> "$NVIDIA_SMI_CALLS"
echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"
"""


def test_launch_asks_nvidia_smi_once(tmp_path):
    """Without CUDA_VISIBLE_DEVICES, `launch` lists the host's GPUs with `nvidia-smi -L`
    (here a script standing in for it, on a host without GPUs), once per launch."""
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text(FAKE_NVIDIA_SMI)
    tool.chmod(0o755)
    calls = tmp_path / "calls"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(
        JAX_PLATFORMS="cuda",
        NVIDIA_SMI_CALLS=str(calls),
        PATH=f"{tool.parent}{os.pathsep}{env.get('PATH', '')}",
    )
    result = subprocess.run(
        [sys.executable, "-m", "hybridrec", "launch", "-n", "2", "--", "train"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "2 processes x 1 devices need 2 GPUs" in result.stderr
    assert "on this host sees 1" in result.stderr
    assert calls.read_text().splitlines() == ["called"]


def test_train_on_a_raw_log_file_says_to_preprocess_it_first(tmp_path):
    raw = tmp_path / "day_0.tsv"
    raw.write_text("1\t5\ta1\n")
    result = _run("train", "--data", str(raw), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert f"hybridrec preprocess --input {raw} --spec SPEC --output DATA_DIR" in result.stderr
    assert f"hybridrec spec --sample {raw}" in result.stderr
    assert not (tmp_path / "run").exists()


NATIVE_WRITER = """
import os, sys
from hybridrec.cli._chatter import native_output_filtered
with native_output_filtered(enabled=sys.argv[1] == "quiet"):
    print("step 5", flush=True)
    os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks.\\nstep 6\\n")
    os.write(2, b"[Gloo] Rank 1 is connected to 1 peer ranks.\\nwarning kept\\n")
    print("done", end="")
print(" after")
"""


def test_a_process_filters_chatter_written_to_its_own_descriptors():
    """What Gloo writes from C++ to descriptors 1 and 2 is dropped, the rest kept in order."""
    results = {
        mode: subprocess.run(
            [sys.executable, "-c", NATIVE_WRITER, mode],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        for mode in ("quiet", "verbose")
    }
    assert results["quiet"].stdout == "step 5\nstep 6\ndone after\n"
    assert results["quiet"].stderr == "warning kept\n"
    assert results["verbose"].stdout.count("[Gloo]") == 1
    assert results["verbose"].stderr.count("[Gloo]") == 1


def test_evaluate_and_plot_of_a_missing_run_name_the_command_that_makes_one(tmp_path, capsys):
    from hybridrec import cli as command_line

    missing = tmp_path / "no_run"
    assert command_line.main(["evaluate", "--run", str(missing)]) == 2
    assert command_line.main(["plot", str(missing)]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors == [
        f"hybridrec evaluate: error: {missing} does not exist; train one with "
        f"`hybridrec train --data DATA_DIR --run-dir {missing}`",
        f"hybridrec plot: error: run directory {missing} does not exist; "
        f"`hybridrec train --data DATA_DIR --run-dir {missing}` makes one",
    ]
    assert not missing.exists()
