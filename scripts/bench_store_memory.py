"""Benchmark of embedding-store memory: resident memory follows the rows held, not capacity.

In one run, each part in a fresh process (so that resident memory is the store's own):
  1. resident memory of the `criteo_dlrm` layout (26 tables x 8M rows of capacity, dim 16,
     Adagrad, 4 in-process shards) holding --rows rows, filled by training-like batches
     (lookup then apply of 512 x 26 ids); also the store's own `stats()` byte counts;
  2. the time of every lookup and apply while one table grows from empty to --grow-rows
     rows (batches of 4096 x 26 ids, half of them new): the worst call of the batches
     during which the table's memory grew, against the worst call of the others (run
     --repeats times, each in a fresh process; medians over the runs, since a shared
     machine's load moves single calls).
Last line: one JSON object with `rss_gb`, `store_bytes_held_gb`, `store_bytes_at_capacity_gb`,
`worst_growth_ms`, `worst_steady_ms`, `median_steady_ms`, `growth_over_steady` (worst
growth call over worst steady call).

    python scripts/bench_store_memory.py             # ~1 minute on 2 cores
    python scripts/bench_store_memory.py --rows 100000 --grow-rows 500000   # quicker
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np

TABLES = 26
CAPACITY = 8_000_000
DIM = 16
SHARDS = 4


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _tables(count: int, capacity: int):
    from hybridrec.embedding_store import SparseOptimizerConfig, TableConfig

    optimizer = SparseOptimizerConfig(name="adagrad", learning_rate=0.05)
    return [
        TableConfig(name=f"t{i:02d}", dim=DIM, capacity=capacity, optimizer=optimizer)
        for i in range(count)
    ]


def _held(stats: dict) -> int:
    return stats.get("bytes_held", stats.get("bytes", 0))


def measure_resident(rows: int) -> dict:
    """Part 1, run in its own process."""
    from hybridrec.embedding_store import EmbeddingStore

    rng = np.random.default_rng(0)
    store = EmbeddingStore(_tables(TABLES, CAPACITY), num_shards=SHARDS)
    before = _resident_bytes()
    per_table = rows // TABLES
    batch = 512
    # A repeated-id stream like a click log: each table's ids drawn from its own vocabulary,
    # so that about `per_table` distinct ids end up held per table.
    steps = max(1, 3 * per_table // batch)
    start = time.perf_counter()
    for step in range(steps):
        for i in range(TABLES):
            name = f"t{i:02d}"
            ids = rng.integers(0, per_table, batch).astype(np.uint64) * np.uint64(TABLES) + i
            rows_now = store.lookup(name, ids).result()
            store.apply_gradients(name, ids, 0.01 * np.ones_like(rows_now))
        store.set_step(step)
    store.flush()
    stats = store.stats()
    return {
        "rows_held": stats["rows"],
        "rss_gb": _resident_bytes() / 1e9,
        "rss_store_gb": (_resident_bytes() - before) / 1e9,
        "store_bytes_held_gb": _held(stats) / 1e9,
        "store_bytes_at_capacity_gb": stats.get("bytes_at_capacity", _held(stats)) / 1e9,
        "fill_seconds": time.perf_counter() - start,
    }


def measure_growth(grow_rows: int) -> dict:
    """Part 2, run in its own process."""
    from hybridrec.embedding_store import EmbeddingStore

    rng = np.random.default_rng(1)
    store = EmbeddingStore(_tables(1, CAPACITY), num_shards=1)
    batch = 4096 * 26
    next_id = 0
    growth_ms, steady_ms = [], []
    while store.stats()["rows"] < grow_rows:
        fresh = np.arange(next_id, next_id + batch // 2, dtype=np.uint64)
        next_id += len(fresh)
        seen = rng.integers(0, max(1, next_id), batch - len(fresh)).astype(np.uint64)
        ids = np.concatenate([fresh, seen]) * np.uint64(0x9E3779B97F4A7C15)
        held = _held(store.stats())
        start = time.perf_counter()
        rows = store.lookup("t00", ids).result()
        lookup = time.perf_counter() - start
        start = time.perf_counter()
        store.apply_gradients("t00", ids, 0.01 * np.ones_like(rows)).result()
        apply = time.perf_counter() - start
        grew = _held(store.stats()) != held
        (growth_ms if grew else steady_ms).extend([lookup * 1e3, apply * 1e3])
    return {
        "rows_held": store.stats()["rows"],
        "growth_calls": len(growth_ms),
        "worst_growth_ms": max(growth_ms, default=0.0),
        "worst_steady_ms": max(steady_ms, default=0.0),
        "median_steady_ms": statistics.median(steady_ms) if steady_ms else 0.0,
    }


def _in_subprocess(part: str, size: int) -> dict:
    command = [sys.executable, __file__, "--part", part, "--size", str(size)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"{part} part failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=300_000, help="rows held in part 1")
    parser.add_argument("--grow-rows", type=int, default=2_000_000, help="rows grown in part 2")
    parser.add_argument("--repeats", type=int, default=3, help="runs of part 2")
    parser.add_argument("--part", choices=["resident", "growth"], help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        measure = measure_resident if args.part == "resident" else measure_growth
        print(json.dumps(measure(args.size)))
        return 0
    print(f"part 1: {TABLES} tables x {CAPACITY} capacity, ~{args.rows} rows", file=sys.stderr)
    resident = _in_subprocess("resident", args.rows)
    print(f"resident: {json.dumps(resident)}", file=sys.stderr)
    print(f"part 2: one table growing to {args.grow_rows} rows", file=sys.stderr)
    runs = []
    for run in range(args.repeats):
        runs.append(_in_subprocess("growth", args.grow_rows))
        print(f"growth run {run + 1}: {json.dumps(runs[-1])}", file=sys.stderr)
    growth = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    summary = {
        "rss_gb": resident["rss_gb"],
        "rss_store_gb": resident["rss_store_gb"],
        "store_bytes_held_gb": resident["store_bytes_held_gb"],
        "store_bytes_at_capacity_gb": resident["store_bytes_at_capacity_gb"],
        "rows_held": resident["rows_held"],
        "worst_growth_ms": growth["worst_growth_ms"],
        "worst_steady_ms": growth["worst_steady_ms"],
        "median_steady_ms": growth["median_steady_ms"],
        "growth_over_steady": growth["worst_growth_ms"] / max(growth["worst_steady_ms"], 1e-9),
    }
    print(json.dumps({key: round(value, 3) for key, value in summary.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
