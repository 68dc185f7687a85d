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


def _span_names(path):
    with gzip.open(path, "rt") as file:
        events = json.load(file)["traceEvents"]
    return {event["name"] for event in events if event.get("ph") == "X"}


def test_summary_counts_self_time_busy_time_and_pools(tmp_path):
    trace = _trace(
        tmp_path / "perfetto_trace.json.gz",
        [
            # the host thread: a dispatch of 100 us holding a copy of 30 us, 50 us idle in a
            # waiting span, then a dispatch of 60 us that waits 20 us inside; each dispatch
            # traced twice, one span inside the other (as JAX does): one call each
            (1, 10, 0, 100, "PjitFunction(train_step)"),
            (1, 10, 1, 98, "PjitFunction(train_step)"),
            (1, 10, 20, 30, "DevicePut"),
            (1, 10, 100, 50, "ThunkExecutor::Execute (wait for completion)"),
            (1, 10, 150, 60, "PjitFunction(train_step)"),
            (1, 10, 150, 59, "PjitFunction(train_step)"),
            (1, 10, 160, 20, "SlinkyThreadPool::Await"),
            # two threads of one pool; on the first, fusion.2 starts inside fusion.1 and
            # reaches past it: it is cut at fusion.1's end
            (1, 21, 0, 40, "fusion.1"),
            (1, 21, 10, 40, "fusion.2"),
            (1, 22, 0, 20, "fusion.1"),
            # a GPU's two streams, overlapping: busy 400 + 200 us, the device 400 us
            (2, 5, 0, 400, "loop_fusion_kernel"),
            (2, 6, 100, 200, "memcpy"),
        ],
        processes={1: "/host:CPU", 2: "/device:GPU:0"},
        threads={
            (1, 10): "python",
            (1, 21): "tf_XLAEigen/7421648519",
            (1, 22): "tf_XLAEigen/-559357290",
            (2, 5): "Stream #13",
            (2, 6): "Stream #14",
        },
    )
    summary = summarize_trace(trace, steps=2)
    assert summary["steps"] == 2
    # per step: python 70 + 30 + 40 us busy; the pool 10 + 30 + 20 us; the streams 600 us
    assert summary["busy_ms_per_step"] == {
        "/device:GPU:0 Stream": 0.3,
        "python": 0.07,
        "tf_XLAEigen": 0.03,
    }
    assert summary["device_busy_ms_per_step"] == {"/device:GPU:0": 0.2}
    rows = {(row["thread"], row["name"]): row for row in summary["top"]}
    dispatch = rows[("python", "PjitFunction(train_step)")]
    assert dispatch["self_ms_per_step"] == pytest.approx((100 - 30 + 60 - 20) / 2e3)
    assert dispatch["calls_per_step"] == 1
    assert rows[("python", "DevicePut")]["self_ms_per_step"] == pytest.approx(0.015)
    assert rows[("tf_XLAEigen", "fusion.1")]["self_ms_per_step"] == pytest.approx((10 + 20) / 2e3)
    assert rows[("tf_XLAEigen", "fusion.2")]["self_ms_per_step"] == pytest.approx(0.015)
    assert not any("wait" in name.lower() for _, name in rows)  # idle spans are left out
    assert [row["self_ms_per_step"] for row in summary["top"]] == sorted(
        (row["self_ms_per_step"] for row in summary["top"]), reverse=True
    )
    lines = format_summary({**summary, "first_step": 5, "trace": str(trace)})
    assert lines[0].startswith(
        "  profile         steps 5+2: busy ms/step /device:GPU:0 Stream 0.30"
    )
    assert "/device:GPU:0 busy 0.200 ms/step" in lines[1]
    assert "loop_fusion_kernel" in lines[2] and str(trace) in lines[-1]


def test_training_traces_the_steps_it_is_asked_to(dataset, tmp_path, cli, small_model, training):
    run_dir = tmp_path / "run"
    keys = small_model("data.max_steps=12", "log.profile_from=5", "log.profile_steps=4")
    out = cli(*training.args(dataset, run_dir, *keys))
    assert "  profile         steps 5+4: busy ms/step" in out.stdout
    summary = json.loads((run_dir / "summary.json").read_text())["profile"]
    assert summary["first_step"] == 5 and summary["steps"] == 4
    assert json.loads((run_dir / "profile" / "summary.json").read_text()) == summary
    names = {(row["thread"], row["name"]) for row in summary["top"]}
    # the trainer thread dispatched the steps; XLA's threads ran its ops
    assert "python" in summary["busy_ms_per_step"], summary["busy_ms_per_step"]
    assert any("train_step" in name for name in _span_names(summary["trace"]))
    assert any(thread.startswith("tf_XLA") for thread, _ in names), names
    assert summary["trace"].endswith("perfetto_trace.json.gz")


@pytest.mark.parametrize("ends", ["data.max_steps=6", "checkpoint.every_steps=6"])
def test_the_window_ends_before_anything_but_training(
    ends, dataset, tmp_path, cli, small_model, training
):
    """A checkpoint (or the run's end) at step 6 ends a window of steps 4 to 53 there:
    saving, evaluating and the end's drain are not steps."""
    run_dir = tmp_path / "run"
    keys = small_model("data.max_steps=12", ends, "log.profile_from=4", "log.profile_steps=50")
    cli(*training.args(dataset, run_dir, *keys))
    summary = json.loads((run_dir / "summary.json").read_text())["profile"]
    assert summary["first_step"] == 4 and summary["steps"] == 3
    # the trace holds the steps (the top operations of 3 steps may all be XLA's)
    assert any("train_step" in name for name in _span_names(summary["trace"]))


def test_a_run_resumed_past_the_window_says_it_traces_nothing(tmp_path, capsys):
    profiler = StepProfiler(tmp_path, first=5, steps=2, next_step=9)
    assert "log.profile_from = 5: the run starts at step 9; no trace" in capsys.readouterr().err
    for step in (9, 10):
        profiler.before(step)
        profiler.after(step, None)
    profiler.close()
    assert not profiler.tracing and profiler.summary is None
    assert not (tmp_path / "profile").exists()


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
        profiler.after(1, None)
        profiler.after(2, None)
        profiler.close()
        assert not profiler.tracing and profiler.summary is None
        assert "jax.profiler did not start" in capsys.readouterr().err
    finally:
        jax.profiler.stop_trace()
