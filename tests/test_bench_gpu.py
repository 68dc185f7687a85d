"""scripts/bench_gpu.py on the CPU mesh: a small matrix in two invocations that add up to
one report, and its bad input (a platform the machine lacks, a batch the devices do not
divide). On a GPU the same script runs at full size."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax

REPO = Path(__file__).resolve().parent.parent
SMALL = [
    "--rows",
    "12000",
    "--eval-fraction",
    "0.25",
    "--batches",
    "256",
    "--samples",
    "12800",
    "--rounds",
    "1",
]


def bench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_gpu.py"), *SMALL, *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=400,
    )


def last_json(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_two_parts_add_up_to_one_report(tmp_path):
    cache = ["--cache", str(tmp_path)]
    first = last_json(bench("--shapes", "criteo_dlrm", "--staleness", "0", *cache))
    platform, devices = jax.default_backend(), jax.device_count()
    assert first["platform"] == platform and first["devices"] == devices
    assert first["rows"] == 12000
    assert first["distinct_ids"] > first["distinct_ids_long_tail"] > 5_000
    dense, sync = first["dense_only_samples_per_s_b256"], first["hybrid_sync_samples_per_s_b256"]
    assert dense > 0 and sync > 0
    # the ratio of the unrounded rates, to 3 digits; the rates are printed as integers
    assert abs(first["hybrid_over_dense_b256"] - sync / dense) <= 1.5e-3
    assert 0.6 < first["auc_b256"] < 1 and first["host_cores_b256"] > 0
    # the CPU backend reports no device memory, a GPU its peak
    assert ("device_peak_gb_b256" in first) == (platform != "cpu")
    assert "mlperf_shape_samples_per_s" not in first
    # the second part: the MLPerf shape at staleness 4, on the data the first one cached
    second = bench("--shapes", "mlperf", "--staleness", "4", *cache)
    assert "(cached)" in second.stdout
    report = last_json(second)
    assert report["hybrid_sync_samples_per_s_b256"] == sync  # the first part's, kept
    assert report["mlperf_shape_samples_per_s"] == report["mlperf_hybrid_samples_per_s_b256"] > 0
    assert report["mlperf_shape_batch"] == 256
    # the MLPerf shape's dense step is several times the work of criteo_dlrm's
    assert report["mlperf_dense_only_samples_per_s_b256"] < dense
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").open()]
    assert {(r["shape"], r["run"]) for r in records} == {
        ("criteo_dlrm", "dense"),
        ("criteo_dlrm", "k0"),
        ("mlperf", "dense"),
        ("mlperf", "k4"),
    }


def test_bad_input_is_one_line(tmp_path):
    cases = []
    if 500 % jax.device_count():  # with one device every batch divides
        message = f"--batches 500: does not divide over the {jax.device_count()} devices"
        cases.append((["--batches", "500"], {}, message))
    missing = "rocm" if shutil.which("nvidia-smi") else "cuda"  # a platform the host lacks
    cases.append(([], {"JAX_PLATFORMS": missing}, f"JAX cannot start platform '{missing}' here"))
    for args, env, message in cases:
        result = bench(*args, "--cache", str(tmp_path), env=env)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
        assert message in lines[0]
    assert not list(tmp_path.iterdir())  # nothing generated before the input was checked
