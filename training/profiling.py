"""A `jax.profiler` trace of a window of training steps, and where their time went.

`log.profile_from = S` with `log.profile_steps = N` traces steps S to S + N - 1 of a run
into `<run dir>/profile` (TensorBoard's profile plugin and Perfetto read it) and sums the
trace up in `<run dir>/profile/summary.json`, also returned into the run's summary:

- per thread, the milliseconds per step it was busy with traced work; the threads of one
  pool (XLA's compute threads, a GPU's streams) are added up, so a pool can be busy for
  longer than a step takes; spans that wait for other threads do not count;
- per device (a GPU, where the trace shows its activity), the milliseconds per step in
  which anything ran on it;
- the operations and host calls that took the most time per step, each by self time (its
  own time, less the traced calls inside it): XLA's fused ops and kernels, the step's
  dispatch (`PjitFunction(...)`), host-to-device copies (`DevicePut`).

The window holds training steps only: it ends early at a step that checkpoints,
evaluates, publishes or ends the run. A run resumed past step S traces nothing (and says
so). The Python tracer stays off: tracing every Python call would slow the host threads
the trace is meant to measure; the loop's per-stage timers cover the Python side.
A profiler that fails to start or stop costs the run its profile, never the run.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import jax

PROFILE_DIR = "profile"
SUMMARY_FILE = "summary.json"
TOP = 25  # operations listed in the summary

# a thread's name less the id that tells a pool's threads apart ("tf_XLAEigen/7421...")
_POOL_SUFFIX = re.compile(r"(/-?\d+|[ _#-]*\d+)$")
# spans that wait ("ThunkExecutor::Execute (wait for completion)", a pool's "Await"): idle
_WAITING = re.compile(r"wait", re.IGNORECASE)


class StepProfiler:
    """Traces steps `first` .. `first + steps - 1` (none when `first` is 0) of a run whose
    next step is `next_step`.

    `before(step)` starts the trace ahead of the window's first step; `after(step,
    outputs, last=...)` waits for `outputs` of the window's last step (or of a step `last`
    ends it at), stops the trace and sums it up into `summary`. `close()` stops a trace
    the run ended inside.
    """

    def __init__(self, run_dir: str | Path, first: int, steps: int, next_step: int = 1):
        self.directory = Path(run_dir) / PROFILE_DIR
        self.first, self.last = first, first + steps - 1
        self.summary: dict[str, Any] | None = None
        self.tracing = False
        self._traced = 0
        if first and next_step > first:
            _warn(f"log.profile_from = {first}: the run starts at step {next_step}; no trace")

    def before(self, step: int) -> None:
        if step != self.first:  # steps count from 1: never when `first` is 0
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
        try:
            jax.profiler.start_trace(
                str(self.directory), create_perfetto_trace=True, profiler_options=options
            )
        except Exception as error:  # a profile is not worth the run
            _warn(f"log.profile_from: jax.profiler did not start ({error}); no trace")
            return
        self.tracing = True

    def after(self, step: int, outputs: Any, *, last: bool = False) -> None:
        """Counts a traced step; at the window's last step, or one that is `last` (a
        checkpoint, an evaluation or the end comes next), waits for `outputs` and stops."""
        if not self.tracing:
            return
        self._traced += 1
        if step >= self.last or last:
            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        """Stops the trace (if one runs) and sums it up; a failure only costs the profile."""
        if not self.tracing:
            return
        self.tracing = False
        try:
            jax.profiler.stop_trace()
            if not self._traced:
                return
            trace = newest_trace(self.directory)
            summary = {"first_step": self.first, **summarize_trace(trace, self._traced)}
            self.summary = {**summary, "trace": str(trace)}
            (self.directory / SUMMARY_FILE).write_text(json.dumps(self.summary, indent=2) + "\n")
        except Exception as error:
            _warn(f"log.profile_from: the trace could not be stopped or read ({error})")


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def newest_trace(directory: Path) -> Path:
    """The Perfetto trace the newest profiling session under `directory` wrote."""
    traces = sorted(directory.glob("plugins/profile/*/perfetto_trace.json.gz"))
    if not traces:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}/plugins/profile")
    return traces[-1]


def summarize_trace(path: str | Path, steps: int) -> dict[str, Any]:
    """Busy time per thread and per device, and the top operations by self time, per
    step, of a trace in Chrome's JSON trace format (what `jax.profiler` writes as
    perfetto_trace.json.gz)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as file:
        events = json.load(file)
    events = events["traceEvents"] if isinstance(events, dict) else events
    processes, threads = {}, {}
    spans: dict[tuple, list[tuple[float, float, str]]] = defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and "dur" in event:
            key = (event["pid"], event.get("tid"))
            spans[key].append((float(event["ts"]), float(event["dur"]), event["name"]))
        elif event.get("ph") == "M" and event.get("name") == "process_name":
            processes[event["pid"]] = event["args"]["name"]
        elif event.get("ph") == "M" and event.get("name") == "thread_name":
            threads[(event["pid"], event["tid"])] = event["args"]["name"]
    busy: dict[str, float] = defaultdict(float)
    own: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    on_device: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for key, thread_spans in spans.items():
        process = processes.get(key[0], "")
        group = _thread_group(process, threads.get(key, str(key[1])))
        for name, micros, call in _self_times(thread_spans):
            if _WAITING.search(name):
                continue  # idle, though nested spans inside it were not
            busy[group] += micros
            own[(group, name)][0] += micros
            own[(group, name)][1] += call
        if process.startswith("/device"):
            on_device[process] += [
                (t, d) for t, d, name in thread_spans if not _WAITING.search(name)
            ]
    per_step = 1e-3 / max(steps, 1)  # trace microseconds -> milliseconds per step
    top = sorted(own.items(), key=lambda item: -item[1][0])[:TOP]
    return {
        "steps": steps,
        "busy_ms_per_step": {
            group: round(us * per_step, 3)
            for group, us in sorted(busy.items(), key=lambda g: -g[1])
        },
        "device_busy_ms_per_step": {
            device: round(_covered(parts) * per_step, 3) for device, parts in on_device.items()
        },
        "top": [
            {
                "thread": group,
                "name": name,
                "self_ms_per_step": round(us * per_step, 3),
                "calls_per_step": round(calls / max(steps, 1), 2),
            }
            for (group, name), (us, calls) in top
        ],
    }


def format_summary(summary: dict[str, Any], limit: int = 8) -> list[str]:
    """A few lines for the end of a run: busy threads and the top operations."""
    steps = summary["steps"]
    busy = ", ".join(f"{g} {ms:.2f}" for g, ms in list(summary["busy_ms_per_step"].items())[:4])
    lines = [f"  profile         steps {summary['first_step']}+{steps}: busy ms/step {busy}"]
    for device, ms in summary.get("device_busy_ms_per_step", {}).items():
        lines.append(f"                  {device} busy {ms:.3f} ms/step (any of its streams)")
    for row in summary["top"][:limit]:
        lines.append(
            f"                  {row['self_ms_per_step']:8.3f} ms/step  {row['name'][:60]}"
            f"  ({row['thread']}, {row['calls_per_step']:g}/step)"
        )
    lines.append(f"                  trace: {summary['trace']}")
    return lines


def _thread_group(process: str, thread: str) -> str:
    thread = _POOL_SUFFIX.sub("", thread) or "unnamed"
    return f"{process} {thread}" if process.startswith("/device") else thread


def _covered(parts: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one of (start, length) intervals, overlaps once."""
    total, end = 0.0, float("-inf")
    for start, length in sorted(parts):
        stop = start + length
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _self_times(spans: list[tuple[float, float, str]]):
    """(name, self microseconds, calls) of each span on one thread: its duration less its
    children's. A span reaching past its parent's end is cut there, so that the self times
    add up to the time the thread's spans cover. A span directly inside one of the same
    name is the same call (JAX traces each `PjitFunction(...)` twice, one in the other):
    0 calls."""
    stack: list[list] = []  # [end, name, self time, calls] of the open spans, outermost first
    for start, duration, name in sorted(spans, key=lambda s: (s[0], -s[1])):
        while stack and stack[-1][0] <= start:
            _, closed, micros, calls = stack.pop()
            yield closed, micros, calls
        end = start + duration
        calls = 1
        if stack:
            end = min(end, stack[-1][0])
            stack[-1][2] -= end - start
            calls = int(stack[-1][1] != name)
        stack.append([end, name, end - start, calls])
    for _, closed, micros, calls in reversed(stack):
        yield closed, micros, calls
