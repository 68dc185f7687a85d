"""scripts/bench_serve_sequences.py at a tiny size: it generates, trains, exports, serves
under load, measures int8 and fp16 recall, the kept-history cache and how far its model is from
chance, and ends with its keys."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_small_run_ends_with_its_keys(tmp_path):
    command = [sys.executable, str(REPO / "scripts" / "bench_serve_sequences.py")]
    command += ["--items", "3000", "--history", "32", "--k", "20", "--clients", "2"]
    command += ["--duration", "2", "--recall-users", "100", "--cache", str(tmp_path)]
    command += ["--epochs", "20"]  # the preset's cap is 200: its run stops at its best
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert 2000 < summary["catalogue"] <= 3000  # the training split's items
    assert summary["errors"] == 0 and summary["requests_per_s"] > 0
    assert 0 < summary["p50_ms"] <= summary["p99_ms"]
    assert 0.8 < summary["recall_at_k_int8"] <= summary["recall_at_k_fp16"] <= 1
    for key in ("cached_speedup", "cached_request_p50_ms", "full_request_p50_ms"):
        assert summary[key] > 0, key
    # how far the served model is from chance: ln of its catalogue, its loss, its hit rate
    assert abs(summary["loss_at_chance"] - math.log(summary["catalogue"])) < 1e-3
    assert 0 < summary["train_loss"] < 2 * summary["loss_at_chance"]
    assert 0 <= summary["hr_at_10_valid"] <= 1
