"""The steps of scripts/gpu_check.sh, in the environment it prepared: each a child process
with its own time cap, the whole within --budget seconds, one JSON summary at the end.

Steps, in order (a step that fails or runs out of time is recorded, the next one still runs;
first what the open GPU issue asks, then the tests, then the rest in what the budget leaves):
  hstu       scripts/bench_hstu.py: the HSTU attention kernel against the reference at 1k,
             4k and 8k tokens a row, and an HSTU block stack's training step with each;
  hstu_mfu   scripts/bench_hstu.py's training step at NVIDIA's HSTU benchmark shape (8
             blocks, width 1024, 4,096 positions a row, bf16): model FLOP/s against the
             GPU's dense bf16 peak (step_mfu_pallas, step_mfu_reference);
  bench_gpu  scripts/bench_gpu.py at batch 16384: criteo_dlrm and the MLPerf DLRM shape,
             the hybrid loop against the dense step alone, with a profile of the last steps;
  device_ids  scripts/bench_device_rows.py --fused --map-in-step at batch 16384: the
             host's side of the device tables when the step maps the ids, and the
             mapping's time on the device (map_ms_b16384);
  sequences  scripts/bench_sequences.py: the HSTU preset's hybrid loop over 1M items at a
             token budget of 65,536, the item rows in the host store and on the device,
             and the same run with the reference attention, each run's test HR@10 beside
             the other's (hr10_test_gap);
  tests      the JAX-facing tests (pytest, several workers), on the platform JAX_PLATFORMS
             names;
  device_rows  the same as device_ids with the host mapping the ids: each of its three
             stages, on this host's cores;
  input      scripts/bench_input.py at batch 16384 on bench_gpu's data: the Parquet reader
             alone with 1, 2, 4 and 8 window-reading threads (data.read_threads);
  roundtrip  `hybridrec quickstart`: generate -> preprocess -> train -> evaluate -> export ->
             serve;
  hstu_time  scripts/bench_hstu.py at 4k tokens a row with HSTU's time-gap bias (64
             buckets).
--rehearse runs each at a tiny size (the kernel in Pallas interpret mode) on the CPU.

    python scripts/gpu_check.py --out DIR [--rehearse] [--budget SECONDS] [--steps ...]

DIR receives each step's log (STEP.log; device_rows's, device_ids's and input's in
bench_gpu.log, hstu_mfu's in hstu.log), the tests' JUnit
XML and gpu_check.json, which is also the last line printed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# module -> the package that provides it, for a missing one's message
NEEDED = {
    "jax": "jax",
    "flax": "flax",
    "optax": "optax",
    "orbax.checkpoint": "orbax-checkpoint",
    "apache_beam": "apache-beam",
    "tensorstore": "tensorstore",
    "pyarrow": "pyarrow",
    "tensorboardX": "tensorboardX",
    "starlette": "starlette",
    "uvicorn": "uvicorn",
    "scipy": "scipy",
    "matplotlib": "matplotlib",
    "pytest": "pytest",
    "xdist": "pytest-xdist",
    "pytest_timeout": "pytest-timeout",
    "httpx": "httpx",
    "tritonclient.http": "tritonclient[http]",
    "cryptography": "cryptography",
    "hybridrec.embedding_store._native": "hybridrec (its C extensions)",
    "hybridrec.serving._scan": "hybridrec (its C extensions)",
}
# one directory's files side by side: pytest 9.1 (the GPU image's) loses a directory's
# conftest fixtures for its files named after another directory's
TESTS = [
    "tests/model",
    "tests/training/test_end_to_end.py",
    "tests/training/test_device_rows.py",
    "tests/training/test_compilation_cache.py",
    "tests/training/test_resume_and_multiprocess.py",
    "tests/serving",
    "tests/test_config.py",
    "tests/embedding_store",
]
REHEARSAL_TESTS = ["tests/model/test_hstu_attention.py", "-k", "lowers or buckets"]


# steps whose output goes on in another step's log: at most 8 files come back
SHARED_LOGS = {
    "device_rows": "bench_gpu",
    "device_ids": "bench_gpu",
    "input": "bench_gpu",
    "hstu_mfu": "hstu",
}


def _steps(
    rehearse: bool, work: Path, out: Path, selected: list[str] | None
) -> list[tuple[str, list[str], int]]:
    """(name, command, time cap in seconds) of each step."""
    python = sys.executable
    if rehearse:
        hstu = ["--lengths", "64", "--tokens", "128", "--heads", "2", "--head-dim", "16"]
        hstu += ["--block", "16", "--step-length", "64", "--step-dim", "32", "--step-blocks", "1"]
        hstu += ["--step-history", "10", "--min-seconds", "0", "--interpret"]
        tests, workers = REHEARSAL_TESTS, "1"
        bench = ["--rows", "12000", "--eval-fraction", "0.25", "--batches", "256"]
        bench += ["--samples", "12800", "--rounds", "1"]
        rows = "20000"
        device_rows = ["--batches", "256", "--warm", "1", "--batches-timed", "2"]
        reader = ["--rows", "12000", "--eval-fraction", "0.25", "--batch-size", "256"]
        reader += ["--threads", "1", "2"]
        hstu_time = [*hstu, "--time-buckets", "8"]
        mfu = ["--step-blocks", "1", "--step-dim", "32", "--heads", "2", "--head-dim", "16"]
        mfu += ["--step-length", "64", "--tokens", "128", "--block", "16", "--min-seconds", "0"]
        mfu += ["--interpret", "--peak-tflops", "1"]  # a CPU has no bf16 peak of its own
        sequences = ["--users", "200", "--items", "2000", "--mean-events", "10"]
        sequences += ["--longest", "200", "--steps", "6", "--repeats", "1", "--token-budget", "800"]
        # the ids mapped in the step, as "auto" has it on a GPU (the CPU's "auto" is the host)
        bench += ["--set", "embedding.map_ids=devices"]
    else:
        hstu, tests, workers = ["--min-seconds", "0.5", "--extra-blocks", "128"], TESTS, "8"
        bench = ["--rows", "1000000", "--batches", "16384", "--samples", "1000000"]
        bench += ["--rounds", "3", "--profile"]
        rows = "200000"
        device_rows = ["--batches", "16384", "--batches-timed", "30"]
        reader = ["--rows", "1000000", "--threads", "1", "2", "4", "8"]
        hstu_time = ["--min-seconds", "0.5", "--lengths", "4096", "--time-buckets", "64"]
        # NVIDIA's HSTU training benchmark shape (recsys-examples), the step alone
        mfu = ["--step-blocks", "8", "--step-dim", "1024", "--heads", "4", "--head-dim", "256"]
        mfu += ["--step-length", "4096", "--tokens", "32768", "--min-seconds", "0.5"]
        # the HSTU preset's hybrid loop over 1M items at a GPU's token budget
        sequences = ["--items", "1000000", "--users", "20000", "--steps", "100"]
        sequences += ["--token-budget", "65536", "--repeats", "10"]
    # the kernel's run against the reference attention's: speed, and test HR@10 alike
    sequences += ["--models", "hstu", "hstu_reference", "hstu_device", "--evaluate", "20"]
    sequences += ["--cache", str(work / "sequences")]
    mfu += ["--skip", "attention", "--step-history", "0"]
    bench += ["--shapes", "criteo_dlrm", "mlperf", "--staleness", "4"]
    bench += ["--cache", str(work / "bench_gpu"), "--fresh"]
    reader += ["--cache", str(work / "bench_gpu")]  # bench_gpu's data, preprocessed
    tests = selected or tests
    pytest = [python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--timeout", "180"]
    pytest += ["-p", "gpu_check_failures"]  # each failure's report as it happens
    pytest += ["-n", workers, "--dist", "loadfile", "--junitxml", str(out / "tests.xml")]
    # the module's order: what the open GPU issue asks first, then the tests, then the rest
    return [
        ("hstu", [python, "scripts/bench_hstu.py", *hstu], 80),
        ("hstu_mfu", [python, "scripts/bench_hstu.py", *mfu], 60),
        ("bench_gpu", [python, "scripts/bench_gpu.py", *bench], 150),
        ("device_ids", [python, "scripts/bench_device_rows.py", "--fused", "--map-in-step", *device_rows], 30),
        ("sequences", [python, "scripts/bench_sequences.py", *sequences], 120),
        ("tests", [*pytest, *tests], 180),
        ("device_rows", [python, "scripts/bench_device_rows.py", "--fused", *device_rows], 30),
        ("input", [python, "scripts/bench_input.py", *reader], 30),
        ("roundtrip", [python, "-m", "hybridrec", "quickstart", "--rows", rows, "--out", str(work / "quickstart")], 60),
        ("hstu_time", [python, "scripts/bench_hstu.py", *hstu_time], 40),
    ]  # fmt: skip


def _run(command: list[str], log: Path, cap: float, env: dict, append: bool = False) -> dict:
    """Runs `command` in a process group of its own, its output to `log` (after what it
    holds, with `append`); stops the group at `cap` seconds."""
    start = time.perf_counter()
    with log.open("a" if append else "w") as handle:
        handle.write(f"$ {' '.join(command)}\n")
        handle.flush()
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        timed_out = False
        try:
            process.wait(timeout=max(cap, 1))
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(process.pid, sig)
                    process.wait(timeout=grace)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
    seconds = time.perf_counter() - start
    return {"rc": process.returncode, "seconds": round(seconds, 1), "timed_out": timed_out}


def _last_json(log: Path, start: int = 0) -> dict | None:
    """The last line of `log` that is a JSON object, written at or after byte `start`."""
    with log.open("rb") as handle:
        handle.seek(start)
        text = handle.read().decode(errors="replace")
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def _test_results(log: Path, junit: Path) -> dict:
    """Counts of the tests' outcomes: from the JUnit XML of a finished run, else from the
    verbose lines of the log (a run stopped at its cap writes no XML)."""
    failures: list[str] = []
    if junit.exists():
        root = ElementTree.parse(junit).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        for case in suite.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failures.append(f"{case.get('classname')}::{case.get('name')}")
        counts["passed"] = (
            counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        )
        return {**counts, "failed_tests": failures[:30], "complete": True}
    outcomes = {"PASSED": 0, "FAILED": 0, "ERROR": 0, "SKIPPED": 0}
    for line in log.read_text(errors="replace").splitlines():
        match = re.search(r"\b(PASSED|FAILED|ERROR|SKIPPED)\b\s+(\S+::\S+)", line)
        if match:
            outcomes[match.group(1)] += 1
            if match.group(1) in ("FAILED", "ERROR"):
                failures.append(match.group(2))
    return {
        "passed": outcomes["PASSED"],
        "failures": outcomes["FAILED"],
        "errors": outcomes["ERROR"],
        "skipped": outcomes["SKIPPED"],
        "failed_tests": failures[:30],
        "complete": False,
    }


def _roundtrip(work: Path) -> dict:
    summary = work / "quickstart" / "run" / "summary.json"
    if not summary.exists():
        return {"finished": False}
    run = json.loads(summary.read_text())
    exported = (work / "quickstart" / "export").exists()
    return {"finished": exported, "steps": run.get("steps"), "auc": run.get("eval", {}).get("auc")}


def _missing_modules() -> list[str]:
    missing = []
    logging.disable(logging.WARNING)  # Beam's import warns of cloud clients it does not need
    for module, package in NEEDED.items():
        try:
            importlib.import_module(module)
        except ImportError as error:
            missing.append(f"{package} ({module}: {error})")
    logging.disable(logging.NOTSET)
    return missing


def _device() -> dict:
    """The platform and devices JAX finds, in a child (this process holds no device)."""
    probe = (
        "import json, jax; d = jax.devices(); print(json.dumps({'platform': d[0].platform, "
        "'device_kind': d[0].device_kind, 'devices': len(d), 'jax': jax.__version__}))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if result.returncode:
        last = (result.stderr.strip().splitlines() or [""])[-1]
        detail = "" if last in ("", "AssertionError") else last  # JAX only asserts for none
        platform = os.environ.get("JAX_PLATFORMS", "")
        print(
            f"gpu_check: JAX_PLATFORMS={platform}: JAX cannot start {platform or 'a backend'!r} "
            f"here ({detail or 'no such device is visible, or JAX has no plugin for it'})",
            file=sys.stderr,
        )
        sys.exit(2)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rehearse", action="store_true", help="tiny sizes, on the CPU")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for every step")
    parser.add_argument(
        "--steps",
        nargs="+",
        choices=[
            "hstu",
            "hstu_mfu",
            "bench_gpu",
            "device_ids",
            "sequences",
            "tests",
            "device_rows",
            "input",
            "roundtrip",
            "hstu_time",
        ],
    )
    parser.add_argument(
        "--tests", help="pytest's arguments instead of the default set (one string)"
    )
    args = parser.parse_args(argv)
    missing = _missing_modules()
    if missing:
        print(
            f"gpu_check: this environment lacks {'; '.join(missing)}: add it to the "
            "wheelhouse (scripts/gpu_check.sh --fill-wheels) or the image",
            file=sys.stderr,
        )
        sys.exit(2)
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.budget
    summary: dict = {"device": _device(), "rehearse": args.rehearse, "steps": {}}
    print(f"gpu_check: {summary['device']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        work = Path(work)
        steps = _steps(args.rehearse, work, args.out, args.tests and shlex.split(args.tests))
        steps = [step for step in steps if not args.steps or step[0] in args.steps]
        # the tests' plugin (scripts/gpu_check_failures.py) is imported from scripts/
        path = os.pathsep.join(
            p for p in (str(REPO / "scripts"), os.environ.get("PYTHONPATH")) if p
        )
        env = {**os.environ, "PYTHONPATH": path}
        for index, (name, command, cap) in enumerate(steps):
            later = 30 * (len(steps) - index - 1)  # the least each later step is left
            cap = min(cap, deadline - time.perf_counter() - later)
            if args.rehearse:  # a rehearsal's sizes are tiny; its caps only guard a hang
                cap = max(cap, 600)
            if cap < 20:
                summary["steps"][name] = {"skipped": "out of budget"}
                continue
            print(f"== {name} (at most {cap:.0f} s): {' '.join(command[1:])}", flush=True)
            log = args.out / f"{SHARED_LOGS.get(name, name)}.log"
            start = log.stat().st_size if name in SHARED_LOGS and log.exists() else 0
            result = _run(command, log, cap, env, append=name in SHARED_LOGS)
            summary["steps"][name] = {**result, "cap_s": round(cap)}
            if name == "tests":
                summary[name] = _test_results(log, args.out / "tests.xml")
            elif name == "roundtrip":
                summary[name] = _roundtrip(work)
            else:
                summary[name] = _last_json(log, start)  # this step's own lines only
            print(
                f"   {name}: {json.dumps({**result, name: summary.get(name)})[:1500]}", flush=True
            )
    (args.out / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
