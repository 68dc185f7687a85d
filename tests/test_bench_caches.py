"""scripts/bench_hot_rows.py and scripts/bench_device_rows.py --cache at a small size: they
run, fill and churn their caches, and end with the JSON line their keys are read from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _last_json(script: str, *args: str) -> dict:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / script), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_bench_hot_rows_reports_a_full_cache_sampled_and_exact():
    small = ["--capacities", "70000", "--batch", "4096", "--batches-timed", "3", "--scale", "1"]
    sampled = _last_json("bench_hot_rows.py", *small)
    exact = _last_json("bench_hot_rows.py", *small, "--exact")
    for out in (sampled, exact):
        assert set(out) == {
            "seen_ms_c70000",
            "choose_ms_c70000",
            "admitted_per_batch_c70000",
            "hit_rate_c70000",
        }
        assert 0.3 < out["hit_rate_c70000"] < 1  # full and evicting: it admits every batch
        assert out["admitted_per_batch_c70000"] > 0
    assert abs(sampled["hit_rate_c70000"] - exact["hit_rate_c70000"]) < 0.01


def test_bench_device_rows_puts_the_long_tail_behind_a_cache():
    out = _last_json(
        "bench_device_rows.py",
        *("--batches", "1024", "--cache", "4096", "--warm", "3", "--batches-timed", "2"),
        *("--cardinality-scale", "1"),
    )
    assert 0 < out["cache_hit_rate_b1024"] < 1
    assert out["prepare_ms_b1024"] > 0 and out["host_side_samples_per_s_b1024"] > 0
