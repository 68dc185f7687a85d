"""A `jax.profiler` trace of a window of training steps, and where their time went.

`log.profile_from = S` with `log.profile_steps = N` traces steps S to S + N - 1 of a run
into `<run dir>/profile` (TensorBoard's profile plugin and Perfetto read it) and sums the
trace up in `<run dir>/profile/summary.json`, also returned into the run's summary:

- per thread (threads of one pool counted together: XLA's compute threads, a GPU's
  streams), the milliseconds per step it was busy with traced work (spans that wait for
  other threads do not count);
- the operations and host calls that took the most time per step, each by self time (its
  own time, less the traced calls inside it): XLA's fused ops and kernels, the step's
  dispatch (`PjitFunction(...)`), host-to-device copies (`DevicePut`).

The Python tracer stays off: tracing every Python call would slow the host threads the
trace is meant to measure. Host Python work shows as the gaps the summary leaves.
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
    """Traces steps `first` .. `first + steps - 1` (none when `first` is 0).

    `before(step)` starts the trace ahead of the window's first step; `after(step, outputs)`
    waits for the last step's `outputs`, stops the trace and returns its summary (None
    before then). `close()` stops a trace the run ended inside, summing up what it holds.
    """

    def __init__(self, run_dir: str | Path, first: int, steps: int):
        self.directory = Path(run_dir) / PROFILE_DIR
        self.first, self.last = first, first + steps - 1
        self.summary: dict[str, Any] | None = None
        self._tracing = False
        self._traced = 0

    def before(self, step: int) -> None:
        if self.first and step == self.first and not self._tracing:
            self.directory.mkdir(parents=True, exist_ok=True)
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0
            try:
                jax.profiler.start_trace(
                    str(self.directory), create_perfetto_trace=True, profiler_options=options
                )
            except Exception as error:  # a profile is not worth the run
                print(
                    f"log.profile_from: jax.profiler did not start ({error}); training goes "
                    "on without a trace",
                    file=sys.stderr,
                    flush=True,
                )
                return
            self._tracing = True

    def after(self, step: int, outputs: Any) -> dict[str, Any] | None:
        if not self._tracing:
            return None
        self._traced += 1
        if step < self.last:
            return None
        jax.block_until_ready(outputs)
        return self._stop()

    def close(self) -> dict[str, Any] | None:
        return self._stop() if self._tracing else None

    def _stop(self) -> dict[str, Any]:
        jax.profiler.stop_trace()
        self._tracing = False
        trace = newest_trace(self.directory)
        self.summary = {
            "first_step": self.first,
            **summarize_trace(trace, self._traced),
            "trace": str(trace),
        }
        (self.directory / SUMMARY_FILE).write_text(json.dumps(self.summary, indent=2) + "\n")
        return self.summary


def newest_trace(directory: Path) -> Path:
    """The Perfetto trace the newest profiling session under `directory` wrote."""
    traces = sorted(directory.glob("plugins/profile/*/perfetto_trace.json.gz"))
    if not traces:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}/plugins/profile")
    return traces[-1]


def summarize_trace(path: str | Path, steps: int) -> dict[str, Any]:
    """Busy time per thread and the top operations by self time, per step, of a trace in
    Chrome's JSON trace format (what `jax.profiler` writes as perfetto_trace.json.gz)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as file:
        events = json.load(file)
    events = events["traceEvents"] if isinstance(events, dict) else events
    processes, threads = {}, {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            processes[event["pid"]] = event["args"]["name"]
        elif event.get("ph") == "M" and event.get("name") == "thread_name":
            threads[(event["pid"], event["tid"])] = event["args"]["name"]
    spans: dict[tuple, list[tuple[float, float, str]]] = defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and "dur" in event and not _WAITING.search(event["name"]):
            key = (event["pid"], event.get("tid"))
            spans[key].append((float(event["ts"]), float(event["dur"]), event["name"]))
    busy: dict[str, float] = defaultdict(float)
    own: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for key, thread_spans in spans.items():
        group = _thread_group(processes.get(key[0], ""), threads.get(key, str(key[1])))
        busy[group] += _busy(thread_spans)
        for name, seconds in _self_times(thread_spans):
            own[(group, name)][0] += seconds
            own[(group, name)][1] += 1
    per_step = 1e-3 / max(steps, 1)  # trace microseconds -> milliseconds per step
    top = sorted(own.items(), key=lambda item: -item[1][0])[:TOP]
    return {
        "steps": steps,
        "busy_ms_per_step": {
            group: round(us * per_step, 3)
            for group, us in sorted(busy.items(), key=lambda g: -g[1])
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


def _busy(spans: list[tuple[float, float, str]]) -> float:
    """Microseconds covered by at least one span (nested and overlapping ones once)."""
    total, end = 0.0, float("-inf")
    for start, duration, _ in sorted(spans):
        stop = start + duration
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _self_times(spans: list[tuple[float, float, str]]):
    """(name, self microseconds) of each span: its duration less its children's."""
    stack: list[list] = []  # [end, name, self time] of the open spans, outermost first
    for start, duration, name in sorted(spans, key=lambda s: (s[0], -s[1])):
        while stack and stack[-1][0] <= start:
            _, closed, own = stack.pop()
            yield closed, own
        if stack:
            stack[-1][2] -= min(duration, stack[-1][0] - start)
        stack.append([start + duration, name, duration])
    for _, closed, own in reversed(stack):
        yield closed, own
