"""Benchmark of the in-process embedding store on a Zipf-skewed id stream.

In one run (batches of 4096 x 26 ids, Zipf exponent 1.05 over the table's ids):
  1. lookup rows/s vs the numpy bound (`table[rows]` on a preallocated array, same rows),
     dims 16 and 64, over --distinct ids (all of them stored beforehand);
  2. Adagrad apply rows/s vs numpy doing the same math on the same rows (duplicates
     summed with np.unique + np.add.at, gather, update, scatter);
  3. lookup + apply throughput at 1M, 10M and 100M rows of capacity (dim 16, row-wise
     Adagrad so that 100M rows fit in memory; every row stored);
  4. a tiered table of twice its RAM budget vs the same table all in RAM.
Ratios use the median batch time. Last line: one JSON object with `lookup_ratio`,
`apply_ratio` (worst over the dims), `scale_drop`, `tiered_ratio`.

    python scripts/bench_store.py                 # the full run (~10 min on 2 cores)
    python scripts/bench_store.py --quick         # small sizes, a smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from embedding_store import (
    EmbeddingStore,
    InitializerConfig,
    SparseOptimizerConfig,
    TableConfig,
    TieringConfig,
)
from embedding_store._hashing import mix64
from hybridrec.progress import Progress

BATCH = 4096 * 26
ZIPF_EXPONENT = 1.05


def zipf_ranks(rng: np.random.Generator, vocabulary: int, size: int) -> np.ndarray:
    """Bounded Zipf ranks in [0, vocabulary): inverse CDF of the continuous power law."""
    s = ZIPF_EXPONENT
    u = rng.random(size)
    x = ((vocabulary ** (1 - s) - 1) * u + 1) ** (1 / (1 - s))
    return np.minimum(x.astype(np.int64) - 1, vocabulary - 1)


def ids_of(ranks: np.ndarray) -> np.ndarray:
    """Rank -> a scattered uint64 id (as hashed feature ids are)."""
    return mix64(ranks.astype(np.uint64), 12345)


def median_seconds(function: Callable[[int], object], batches: int) -> float:
    function(0)  # warm-up
    times = []
    for i in range(batches):
        start = time.perf_counter()
        function(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fill(store: EmbeddingStore, table: str, rows: int, name: str, chunk: int = 1 << 21) -> float:
    """Stores every id of ranks [0, rows) through training lookups; returns seconds."""
    progress = Progress(f"fill {name}", total=rows, unit="rows")
    for start in range(0, rows, chunk):
        ranks = np.arange(start, min(rows, start + chunk))
        store.lookup(table, ids_of(ranks)).result()
        progress.update(len(ranks))
    progress.close()
    return progress.elapsed


def numpy_adagrad(table, accumulator, rows, grads, lr=0.01, eps=1e-7):
    unique, inverse = np.unique(rows, return_inverse=True)
    summed = np.zeros((len(unique), table.shape[1]), np.float32)
    np.add.at(summed, inverse, grads)
    acc = accumulator[unique] + summed * summed
    accumulator[unique] = acc
    table[unique] = table[unique] - lr * summed / np.sqrt(acc + eps)


def _store_seconds(config, args, ids, grads) -> tuple[float, float]:
    with EmbeddingStore([config], num_shards=args.shards) as store:
        fill(store, "t", args.distinct, f"dim {config.dim}")
        lookup = median_seconds(lambda i: store.lookup("t", ids[i]).result(), args.batches)
        apply = median_seconds(
            lambda i: store.apply_gradients("t", ids[i], grads).result(), args.batches
        )
    return lookup, apply


def _numpy_seconds(args, dim, ranks, grads) -> tuple[float, float]:
    table = np.full((args.distinct, dim), 0.01, np.float32)
    accumulator = np.full((args.distinct, dim), 0.1, np.float32)
    lookup = median_seconds(lambda i: table[ranks[i]], args.batches)
    apply = median_seconds(
        lambda i: numpy_adagrad(table, accumulator, ranks[i], grads), args.batches
    )
    return lookup, apply


def bench_dims(args, rng) -> dict:
    results = {}
    for dim in args.dims:
        config = TableConfig(
            name="t",
            dim=dim,
            capacity=args.distinct,
            optimizer=SparseOptimizerConfig(name="adagrad", learning_rate=0.01),
        )
        ranks = [zipf_ranks(rng, args.distinct, BATCH) for _ in range(args.batches)]
        grads = rng.normal(size=(BATCH, dim)).astype(np.float32)
        if not wait_for_memory(int(args.distinct * (dim * 8 + 80) * 1.3), f"dim {dim}"):
            continue
        lookup, apply = _store_seconds(config, args, [ids_of(r) for r in ranks], grads)
        gc.collect()
        numpy_lookup, numpy_apply = _numpy_seconds(args, dim, ranks, grads)
        gc.collect()
        distinct_per_batch = int(np.mean([len(np.unique(r)) for r in ranks[:5]]))
        results[dim] = {
            "lookup_rows_per_s": BATCH / lookup,
            "numpy_lookup_rows_per_s": BATCH / numpy_lookup,
            "lookup_ratio": numpy_lookup / lookup,
            "apply_rows_per_s": BATCH / apply,
            "numpy_apply_rows_per_s": BATCH / numpy_apply,
            "apply_ratio": numpy_apply / apply,
            "distinct_ids_per_batch": distinct_per_batch,
        }
        print(f"dim {dim}: {json.dumps(_rounded(results[dim]))}", file=sys.stderr)
    return results


def _available_bytes() -> int:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def wait_for_memory(needed: int, what: str, patience: float = 300.0) -> bool:
    """Waits (up to `patience` s) until `needed` bytes are available; False if they never are.

    The machine may be shared: starting a measurement that does not fit would push
    another process into the kernel's OOM killer.
    """
    deadline = time.monotonic() + patience
    while _available_bytes() < needed:
        if time.monotonic() > deadline:
            print(
                f"{what}: skipped, needs ~{needed / 2**30:.1f} GiB, "
                f"{_available_bytes() / 2**30:.1f} GiB available",
                file=sys.stderr,
            )
            return False
        time.sleep(10)
    return True


def lookup_apply_seconds(store, vocabulary, rng, batches, dim=16) -> float:
    ids = [ids_of(zipf_ranks(rng, vocabulary, BATCH)) for _ in range(batches)]
    grads = rng.normal(size=(BATCH, dim)).astype(np.float32)

    def step(i):
        store.lookup("t", ids[i]).result()
        store.apply_gradients("t", ids[i], grads).result()

    return median_seconds(step, batches)


def bench_scale(args, rng) -> dict:
    results = {}
    for capacity in args.scale:
        # row-wise Adagrad: 100M x 16 f32 values (6.4 GB) + 4 B state + ~70 B map/metadata.
        if not wait_for_memory(int(capacity * (16 * 4 + 4 + 70) * 1.25), f"scale {capacity}"):
            continue
        config = TableConfig(
            name="t",
            dim=16,
            capacity=capacity,
            initializer=InitializerConfig(kind="zeros"),  # fill speed is not measured here
            optimizer=SparseOptimizerConfig(name="rowwise_adagrad"),
        )
        with EmbeddingStore([config], num_shards=args.shards) as store:
            fill(store, "t", capacity, f"capacity {capacity}")
            seconds = lookup_apply_seconds(store, capacity, rng, args.batches)
            stats = store.stats()
        results[capacity] = {"rows_per_s": BATCH / seconds, "bytes": stats["bytes"]}
        print(f"capacity {capacity}: {json.dumps(_rounded(results[capacity]))}", file=sys.stderr)
        gc.collect()
    return results


def bench_tiered(args, rng) -> dict:
    rows = args.tiered_rows
    base = TableConfig(
        name="t",
        dim=16,
        capacity=rows,
        optimizer=SparseOptimizerConfig(name="adagrad", learning_rate=0.01),
    )
    results = {}
    if not wait_for_memory(rows * 300, "tiered"):
        return results
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as cold:
        tiered = dataclasses.replace(base, tiering=TieringConfig(ram_rows=rows // 2, path=cold))
        for name, config in (("in_ram", base), ("tiered", tiered)):
            with EmbeddingStore([config], num_shards=args.shards) as store:
                fill_seconds = fill(store, "t", rows, name, chunk=max(1, rows // 8))
                seconds = lookup_apply_seconds(store, rows, np.random.default_rng(7), args.batches)
                stats = store.stats()
            results[name] = {
                "rows_per_s": BATCH / seconds,
                "fill_seconds": fill_seconds,
                "cold_reads": stats.get("cold_reads", 0),
                "cold_writes": stats.get("cold_writes", 0),
            }
            print(f"tiered {name}: {json.dumps(_rounded(results[name]))}", file=sys.stderr)
            gc.collect()
    return results


def _rounded(data):
    if isinstance(data, dict):
        return {k: _rounded(v) for k, v in data.items()}
    return round(data, 3) if isinstance(data, float) else data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--distinct", type=int, default=10_000_000, help="ids for steps 1-2")
    parser.add_argument("--dims", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--scale", type=int, nargs="+", default=[10**6, 10**7, 10**8])
    parser.add_argument("--tiered-rows", type=int, default=2_000_000, help="rows, RAM = half")
    parser.add_argument("--batches", type=int, default=15, help="timed batches per measurement")
    parser.add_argument("--shards", type=int, default=1, help="in-process shards")
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.distinct, args.scale, args.tiered_rows, args.batches = (
            200_000,
            [50_000, 200_000],
            200_000,
            3,
        )
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    dims = bench_dims(args, rng)
    scale = bench_scale(args, rng)
    tiered = bench_tiered(args, rng)
    sizes = sorted(scale)
    summary = {
        "lookup_ratio": min((r["lookup_ratio"] for r in dims.values()), default=None),
        "apply_ratio": min((r["apply_ratio"] for r in dims.values()), default=None),
        "scale_drop": 1 - scale[sizes[-1]]["rows_per_s"] / scale[sizes[0]]["rows_per_s"]
        if len(sizes) > 1
        else None,
        "tiered_ratio": tiered["tiered"]["rows_per_s"] / tiered["in_ram"]["rows_per_s"]
        if tiered
        else None,
        "scale_rows": sizes,
        "dims": {str(d): _rounded(r) for d, r in dims.items()},
        "scale": {str(c): _rounded(r) for c, r in scale.items()},
        "tiered": _rounded(tiered),
        "shards": args.shards,
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(_rounded(summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
