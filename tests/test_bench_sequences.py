"""scripts/bench_sequences.py at a tiny size: it generates, fills the store, trains through
the hybrid loop, times the dense step alone and a matmul, and ends with its keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_small_run_ends_with_its_keys(tmp_path):
    command = [sys.executable, str(REPO / "scripts" / "bench_sequences.py"), "--models", "hstu"]
    command += ["--users", "300", "--items", "3000", "--mean-events", "20", "--longest", "500"]
    command += ["--steps", "12", "--repeats", "2", "--token-budget", "1600"]
    command += ["--cache", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("tokens_per_s", "dense_tokens_per_s", "loop_over_dense", "flops_over_matmul"):
        assert summary[key] > 0, key
    assert 0 <= summary["padding_fraction"] < 0.5
    assert summary["store_rows"] >= 3000  # the item table filled before training
    assert summary["peak_rss_gb"] > 0.1
    assert summary["hr10_sports"] is None  # no --quality given
