"""`log.profile_from`: a jax.profiler trace of a window of steps, and its summary."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import jax
import pytest
from hybridrec.training.profiling import StepProfiler, format_summary, summarize_trace


def _trace(path, events, processes, threads):
    meta = [
        {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
        for pid, name in processes.items()
    ] + [
        {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}
        for (pid, tid), name in threads.items()
    ]
    spans = [
        {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}
        for pid, tid, ts, dur, name in events
    ]
    with gzip.open(path, "wt") as file:
        json.dump({"displayTimeUnit": "ns", "traceEvents": meta + spans}, file)
    return path


def test_summary_counts_self_time_busy_time_and_pools(tmp_path):
    trace = _trace(
        tmp_path / "perfetto_trace.json.gz",
        [
            # the host thread: a dispatch of 100 us holding a copy of 30 us, then 50 us idle
            # inside a waiting span (not busy), then another dispatch of 60 us
            (1, 10, 0, 100, "PjitFunction(train_step)"),
            (1, 10, 20, 30, "DevicePut"),
            (1, 10, 100, 50, "ThunkExecutor::Execute (wait for completion)"),
            (1, 10, 150, 60, "PjitFunction(train_step)"),
            # two threads of one pool: overlapping ops on one (busy once), one on the other
            (1, 21, 0, 40, "fusion.1"),
            (1, 21, 10, 40, "fusion.2"),
            (1, 22, 0, 20, "fusion.1"),
            # a GPU stream: its process names it
            (2, 5, 0, 400, "loop_fusion_kernel"),
        ],
        processes={1: "/host:CPU", 2: "/device:GPU:0"},
        threads={
            (1, 10): "python",
            (1, 21): "tf_XLAEigen/7421648519",
            (1, 22): "tf_XLAEigen/-559357290",
            (2, 5): "Stream #13",
        },
    )
    summary = summarize_trace(trace, steps=2)
    assert summary["steps"] == 2
    # per step: python 160 us busy; the pool 50 + 20 us; the stream 400 us
    assert summary["busy_ms_per_step"] == {
        "/device:GPU:0 Stream": 0.2,
        "python": 0.08,
        "tf_XLAEigen": 0.035,
    }
    rows = {(row["thread"], row["name"]): row for row in summary["top"]}
    dispatch = rows[("python", "PjitFunction(train_step)")]
    assert dispatch["self_ms_per_step"] == pytest.approx((100 - 30 + 60) / 2e3)
    assert dispatch["calls_per_step"] == 1
    assert rows[("python", "DevicePut")]["self_ms_per_step"] == pytest.approx(0.015)
    # fusion.2 starts inside fusion.1 on the same thread: fusion.1 keeps the part outside
    assert rows[("tf_XLAEigen", "fusion.1")]["self_ms_per_step"] == pytest.approx((10 + 20) / 2e3)
    assert rows[("tf_XLAEigen", "fusion.2")]["self_ms_per_step"] == pytest.approx(0.02)
    assert not any("wait" in name for _, name in rows)  # idle spans are left out
    assert [row["self_ms_per_step"] for row in summary["top"]] == sorted(
        (row["self_ms_per_step"] for row in summary["top"]), reverse=True
    )
    lines = format_summary({**summary, "first_step": 5, "trace": str(trace)})
    assert lines[0].startswith(
        "  profile         steps 5+2: busy ms/step /device:GPU:0 Stream 0.20"
    )
    assert "loop_fusion_kernel" in lines[1] and str(trace) in lines[-1]


def test_training_traces_the_steps_it_is_asked_to(dataset, tmp_path, cli, small_model, training):
    run_dir = tmp_path / "run"
    keys = small_model("data.max_steps=12", "log.profile_from=5", "log.profile_steps=4")
    out = cli(*training.args(dataset, run_dir, *keys))
    assert "  profile         steps 5+4: busy ms/step" in out.stdout
    summary = json.loads((run_dir / "summary.json").read_text())["profile"]
    assert summary["first_step"] == 5 and summary["steps"] == 4
    assert json.loads((run_dir / "profile" / "summary.json").read_text()) == summary
    names = {(row["thread"], row["name"]) for row in summary["top"]}
    # the trainer thread ran the step; XLA's threads its ops
    assert any("train_step" in name for thread, name in names if thread == "python"), names
    assert any(thread.startswith("tf_XLA") for thread, _ in names), names
    assert summary["trace"].endswith("perfetto_trace.json.gz")


def test_a_run_that_ends_inside_the_window_sums_up_what_it_traced(
    dataset, tmp_path, cli, small_model, training
):
    run_dir = tmp_path / "run"
    keys = small_model("data.max_steps=6", "log.profile_from=4", "log.profile_steps=50")
    cli(*training.args(dataset, run_dir, *keys))
    summary = json.loads((run_dir / "summary.json").read_text())["profile"]
    assert summary["first_step"] == 4 and summary["steps"] == 3


def test_bad_profile_keys_end_with_one_line_naming_them(dataset, tmp_path, training):
    for key in ("log.profile_from=-1", "log.profile_steps=0"):
        args = training.args(dataset, tmp_path / "run", "--set", key)
        result = subprocess.run(
            [sys.executable, "-m", "hybridrec", *args], capture_output=True, text=True, timeout=120
        )
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, result.stderr[-2000:]
        assert len(lines) == 1, result.stderr[-2000:]
        assert "log.profile_from must be >= 0 and log.profile_steps >= 1" in lines[0]


def test_a_profiler_that_cannot_start_leaves_the_run_alone(tmp_path, capsys):
    jax.profiler.start_trace(str(tmp_path / "another"))  # one trace at a time per process
    try:
        profiler = StepProfiler(tmp_path, first=1, steps=2)
        profiler.before(1)
        assert profiler.after(1, None) is None and profiler.after(2, None) is None
        assert profiler.close() is None and profiler.summary is None
        assert "jax.profiler did not start" in capsys.readouterr().err
    finally:
        jax.profiler.stop_trace()
