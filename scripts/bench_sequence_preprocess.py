"""Event logs to user histories: `hybridrec preprocess` with an event spec on the
DirectRunner and on Dask, against a single-process pyarrow baseline doing the same grouping.

Data: `hybridrec generate --events` (--users; the events follow from --mean-events), cached
under --cache by its arguments. Each run is a fresh process (peak memory: the resident
bytes of it and its worker processes together, sampled); the baseline reads the same CSV with pyarrow, hashes nothing, sorts the events by
(user, time) and writes one list row a user (items, times, actions; zstd, the job's codec),
no splits: the work every history job does at least. A smaller run (--small-users) shows how peak memory grows
with the input.

    python scripts/bench_sequence_preprocess.py                      # 10M events
    python scripts/bench_sequence_preprocess.py --users 20000 --small-users 4000   # a small run

The job and the baseline run --repeat times in turns; the rates are each one's median.
The last line is one JSON object: events, events_per_s_direct, events_per_s_dask,
events_per_s_pyarrow, direct_over_pyarrow (and direct_over_pyarrow_runs, each turn's),
peak_rss_gb (the DirectRunner's, all its processes), peak_rss_gb_small and events_small
(the smaller input's).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _tree_rss(root: int) -> int:
    """Bytes resident in `root` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        rss[int(entry)] = int(fields[21]) * resource.getpagesize()
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack += children.get(pid, [])
    return total


def _child(command: list[str]) -> tuple[float, float]:
    """Runs `command`; (wall seconds, peak GB resident in it and its worker processes
    together, sampled every 0.2 s)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO)
    peak = 0
    while process.poll() is None:
        peak = max(peak, _tree_rss(process.pid))
        time.sleep(0.2)
    if process.returncode:
        sys.exit(f"bench_sequence_preprocess: {' '.join(command[:4])} ... failed")
    return time.perf_counter() - start, peak / 2**30


def _generate(cache: Path, users: int, mean_events: float, items: int, seed: int) -> Path:
    from hybridrec.pipeline.events.synthetic_events import VERSION

    folder = cache / f"events-v{VERSION}-u{users}-m{mean_events:g}-i{items}-s{seed}"
    if (folder / "events.toml").exists():
        print(f"generated log: {folder} (cached)", flush=True)
        return folder
    partial = folder.with_suffix(".partial")
    shutil.rmtree(partial, ignore_errors=True)
    command = [sys.executable, "-m", "hybridrec", "generate", "--events", "-o", str(partial)]
    command += ["--users", str(users), "--mean-events", str(mean_events), "--items", str(items)]
    command += ["--seed", str(seed)]
    subprocess.run(command, cwd=REPO, check=True)
    partial.rename(folder)
    # the spec names items.csv relative to itself: it moved with the folder
    return folder


def _events(folder: Path) -> int:
    with open(folder / "events.csv", "rb") as handle:
        return sum(block.count(b"\n") for block in iter(lambda: handle.read(1 << 24), b"")) - 1


def _preprocess(folder: Path, out: Path, runner: str, workers: int, bucket_mb: float):
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "hybridrec", "preprocess", "-i", str(folder / "events.csv")]
    command += ["--spec", str(folder / "events.toml"), "-o", str(out), "--quiet"]
    command += ["--bucket-mb", str(bucket_mb)]
    if runner == "dask":
        command += ["--runner", "dask", "--dask-workers", str(workers)]
    else:
        command += [f"--direct_num_workers={workers}"]
    seconds, rss = _child(command)
    print(f"== {runner}: {seconds:.1f} s, peak RSS {rss:.2f} GB", flush=True)
    return seconds, rss


BASELINE = """
import sys, time, pyarrow as pa, pyarrow.csv as csv, pyarrow.compute as pc, pyarrow.parquet as pq
source, target = sys.argv[1], sys.argv[2]
table = csv.read_csv(source, convert_options=csv.ConvertOptions(
    include_columns=["user_id", "item_id", "timestamp", "action"],
    column_types={"user_id": pa.string(), "item_id": pa.string(), "timestamp": pa.int64(),
                  "action": pa.string()}))
table = table.sort_by([("user_id", "ascending"), ("timestamp", "ascending")])
grouped = table.group_by("user_id", use_threads=False).aggregate(
    [("item_id", "list"), ("timestamp", "list"), ("action", "list")])
pq.write_table(grouped, target, compression="zstd")  # the job's codec
"""


def _baseline(folder: Path, out: Path) -> tuple[float, float]:
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-c",
        BASELINE,
        str(folder / "events.csv"),
        str(out / "users.parquet"),
    ]
    seconds, rss = _child(command)
    print(f"== pyarrow baseline: {seconds:.1f} s, peak RSS {rss:.2f} GB", flush=True)
    return seconds, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=200_000, help="users (x mean events)")
    parser.add_argument("--mean-events", type=float, default=50.0)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--small-users", type=int, default=20_000, help="the smaller input")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cache", type=Path, default=REPO / "runs" / "bench_sequence_preprocess")
    parser.add_argument("--skip-dask", action="store_true")
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="preprocess --bucket-mb")
    parser.add_argument("--repeat", type=int, default=3, help="runs of the job and the baseline")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat: at least 1")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    big = _generate(args.cache, args.users, args.mean_events, args.items, args.seed)
    small = _generate(args.cache, args.small_users, args.mean_events, args.items, args.seed)
    events, events_small = _events(big), _events(small)
    print(f"events: {events:,} (small: {events_small:,})", flush=True)
    work = args.cache / "out"
    # the job and the baseline in turns, each one's median: a run's wall time on a small
    # VM moves by a tenth or more with what the machine did just before
    direct, baseline = [], []
    for _ in range(args.repeat):
        direct.append(_preprocess(big, work / "direct", "direct", args.workers, args.bucket_mb))
        baseline.append(_baseline(big, work / "pyarrow"))
    direct_s, baseline_s = statistics.median(s for s, _ in direct), statistics.median(s for s, _ in baseline)  # fmt: skip
    direct_rss = max(rss for _, rss in direct)
    print(
        f"== median of {args.repeat}: direct {direct_s:.1f} s "
        f"({', '.join(f'{s:.1f}' for s, _ in direct)}), pyarrow {baseline_s:.1f} s "
        f"({', '.join(f'{s:.1f}' for s, _ in baseline)})",
        flush=True,
    )
    _, small_rss = _preprocess(small, work / "small", "direct", args.workers, args.bucket_mb)
    summary = {"events": events, "events_per_s_direct": round(events / direct_s)}
    if not args.skip_dask:
        dask_s, _ = _preprocess(big, work / "dask", "dask", args.workers, args.bucket_mb)
        summary["events_per_s_dask"] = round(events / dask_s)
    summary["events_per_s_pyarrow"] = round(events / baseline_s)
    summary["direct_over_pyarrow"] = round(baseline_s / direct_s, 3)
    summary["direct_over_pyarrow_runs"] = [round(b / d, 3) for (d, _), (b, _) in zip(direct, baseline, strict=True)]  # fmt: skip
    summary["peak_rss_gb"] = round(direct_rss, 2)
    summary["peak_rss_gb_small"] = round(small_rss, 2)
    summary["events_small"] = events_small
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
