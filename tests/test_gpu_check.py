"""scripts/gpu_check.sh: its CPU rehearsal runs every step at a tiny size and ends with one
JSON summary, so a broken check is found here rather than on a borrowed GPU; its bad input
(no wheelhouse, a platform that cannot start, a package the environment lacks) is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(command: list[str], env: dict | None = None, timeout: float = 600):
    return subprocess.run(
        command,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_rehearsal_runs_every_step(tmp_path):
    result = run(["bash", "scripts/gpu_check.sh", "--rehearse", "--out", str(tmp_path)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary == json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["rehearse"] and summary["device"]["platform"] == "cpu"
    steps = summary["steps"]
    assert list(steps) == [
        "hstu", "hstu_mfu", "bench_gpu", "device_ids", "sequences", "tests", "device_rows",
        "input", "roundtrip", "hstu_time",
    ]  # fmt: skip
    assert all(step["rc"] == 0 and not step["timed_out"] for step in steps.values()), steps
    hstu = summary["hstu"]  # the kernel, interpreted, against the reference
    assert hstu["kernel_max_error"] < 0.05
    assert hstu["attention_ms_pallas_l64"] > 0 and hstu["step_tokens_per_s_pallas"] > 0
    mfu = summary["hstu_mfu"]  # the step's model FLOP/s over the given peak
    assert mfu["peak_tflops"] == 1 and mfu["step_mfu_pallas"] > 0 and mfu["step_mfu_reference"] > 0
    timed = summary["hstu_time"]  # the same with the time-gap bias
    assert timed["time_buckets"] == 8 and timed["kernel_max_error"] < 0.05
    assert summary["tests"]["passed"] >= 2 and summary["tests"]["complete"]
    assert summary["tests"]["failures"] == summary["tests"]["errors"] == 0
    stages = summary["device_rows"]  # the host's side of the device tables
    assert stages["host_side_samples_per_s_b256"] > 0 and stages["shapes_b256"] >= 1
    in_step = summary["device_ids"]  # the same, the ids mapped in the step
    assert in_step["map_ms_b256"] > 0 and in_step["dedupe_ms_b256"] == 0
    reader = summary["input"]  # the Parquet reader alone, on bench_gpu's data
    assert reader["rows_per_s_t1"] > 0 and reader["rows_per_s_t2"] > 0
    assert reader["batch_size"] == 256 and reader["best_threads"] in (1, 2)
    bench = summary["bench_gpu"]
    assert bench["hybrid_over_dense_b256"] > 0 and bench["mlperf_shape_samples_per_s"] > 0
    assert bench["ids_in_step_b256"] and bench["mlperf_ids_in_step_b256"]  # as on a GPU
    assert summary["roundtrip"]["finished"] and 0.5 < summary["roundtrip"]["auc"] < 1
    loop = summary["sequences"]["models"]  # the HSTU loop, item rows on the host and device
    assert loop["hstu"]["tokens_per_s"] > 0 and loop["hstu_device"]["loop_over_dense"] > 0
    # the kernel's run and the reference attention's, evaluated on the test split
    compared = summary["sequences"]
    assert 0 <= compared["hr10_test_hstu"] <= 1 and 0 <= compared["hr10_test_hstu_reference"] <= 1
    assert "hr10_test_gap" in compared
    # at most 8 files come back from the GPU machine
    files = sorted(path.name for path in tmp_path.iterdir())
    assert len(files) <= 8 and "gpu_check.json" in files and "tests.xml" in files


def test_bad_input_is_one_line(tmp_path):
    missing = run(
        ["bash", "scripts/gpu_check.sh", "--out", str(tmp_path), "--wheels", "/nonexistent"]
    )
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        "gpu_check: wheelhouse /nonexistent not found: fill it where an index is reachable "
        "with scripts/gpu_check.sh --fill-wheels /nonexistent, and carry it"
    ]
    check = [sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path)]
    no_cuda = run(check, env={"JAX_PLATFORMS": "cuda"})
    assert no_cuda.returncode == 2
    lines = no_cuda.stderr.strip().splitlines()
    assert len(lines) == 1 and "JAX cannot start 'cuda' here" in lines[0], no_cuda.stderr
    # a package the environment lacks is named
    shadow = tmp_path / "shadow" / "tensorboardX"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not installed')\n")
    lacking = run(check, env={"PYTHONPATH": str(shadow.parent), "JAX_PLATFORMS": "cpu"})
    assert lacking.returncode == 2
    lines = lacking.stderr.strip().splitlines()
    assert len(lines) == 1 and "this environment lacks tensorboardX" in lines[0], lacking.stderr
    assert not (tmp_path / "gpu_check.json").exists()
