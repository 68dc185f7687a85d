"""scripts/bench_sequence_preprocess.py at a tiny size: it generates, preprocesses (twice,
two sizes) and runs the pyarrow baseline, and ends with its keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_small_run_ends_with_its_keys(tmp_path):
    command = [sys.executable, str(REPO / "scripts" / "bench_sequence_preprocess.py")]
    command += ["--users", "600", "--small-users", "200", "--items", "500", "--skip-dask"]
    command += ["--mean-events", "20", "--cache", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["events"] > summary["events_small"] > 1000
    assert summary["events_per_s_direct"] > 0 and summary["events_per_s_pyarrow"] > 0
    assert summary["direct_over_pyarrow"] > 0
    assert summary["peak_rss_gb"] > 0.05 and summary["peak_rss_gb_small"] > 0.05
    assert "events_per_s_dask" not in summary
