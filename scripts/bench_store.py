"""Benchmark of the in-process embedding store on a Zipf-skewed id stream.

In one run (batches of 4096 x 26 ids, Zipf exponent 1.05 over the table's ids):
  1. lookup rows/s vs the numpy bound (`table[rows]` on a preallocated array, same rows),
     dims 16 and 64, over --distinct ids (all of them stored beforehand);
  2. Adagrad apply rows/s vs numpy doing the same math on the same rows (duplicates
     summed with np.unique + np.add.at, gather, update, scatter);
  3. lookup + apply throughput at 1M, 10M and 100M rows of capacity (dim 16, row-wise
     Adagrad so that 100M rows fit in memory; every row stored);
  4. a tiered table of twice its RAM budget vs the same table all in RAM.
Ratios use the median batch time; the compared measurements of each part alternate batch
by batch, so a shared machine's changing load affects them alike. Last line: one JSON object with `lookup_ratio`,
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
from hybridrec.common.progress import Progress
from hybridrec.embedding_store import (
    EmbeddingStore,
    InitializerConfig,
    SparseOptimizerConfig,
    TableConfig,
    TieringConfig,
)

BATCH = 4096 * 26
ZIPF_EXPONENT = 1.05


def zipf_ranks(rng: np.random.Generator, vocabulary: int, size: int) -> np.ndarray:
    """Bounded Zipf ranks in [0, vocabulary): inverse CDF of the continuous power law."""
    s = ZIPF_EXPONENT
    u = rng.random(size)
    x = ((vocabulary ** (1 - s) - 1) * u + 1) ** (1 / (1 - s))
    return np.minimum(x.astype(np.int64) - 1, vocabulary - 1)


def ids_of(ranks: np.ndarray) -> np.ndarray:
    """Rank -> a scattered uint64 id (as hashed feature ids are): an odd multiplier mod 2**64."""
    return ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)


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


def _interleaved_medians(functions: dict[str, Callable[[int], object]], batches: int) -> dict:
    """Median seconds of each function, alternating them batch by batch.

    On a shared machine the load drifts; alternating keeps the compared measurements
    under the same conditions.
    """
    times: dict[str, list[float]] = {name: [] for name in functions}
    for function in functions.values():
        function(0)  # warm-up
    for i in range(batches):
        for name, function in functions.items():
            start = time.perf_counter()
            function(i)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _dim_seconds(config, args, ranks, grads) -> dict:
    ids = [ids_of(r) for r in ranks]
    with EmbeddingStore([config], num_shards=args.shards) as store:
        fill(store, "t", args.distinct, f"dim {config.dim}")
        table = np.full((args.distinct, config.dim), 0.01, np.float32)
        accumulator = np.full((args.distinct, config.dim), 0.1, np.float32)
        return _interleaved_medians(
            {
                "lookup": lambda i: store.lookup("t", ids[i]).result(),
                "numpy_lookup": lambda i: table[ranks[i]],
                "apply": lambda i: store.apply_gradients("t", ids[i], grads).result(),
                "numpy_apply": lambda i: numpy_adagrad(table, accumulator, ranks[i], grads),
            },
            args.batches,
        )


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
        if not wait_for_memory(int(args.distinct * (dim * 16 + 80) * 1.3), f"dim {dim}"):
            continue
        seconds = _dim_seconds(config, args, ranks, grads)
        gc.collect()
        lookup, apply = seconds["lookup"], seconds["apply"]
        numpy_lookup, numpy_apply = seconds["numpy_lookup"], seconds["numpy_apply"]
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


def _lookup_apply(store, ids, grads) -> Callable[[int], None]:
    def run(i):
        store.lookup("t", ids[i]).result()
        store.apply_gradients("t", ids[i], grads).result()

    return run


def bench_scale(args, rng) -> dict:
    """All capacities stored at once, their batches alternating (same load for each)."""
    stores, ranks = {}, {}
    grads = rng.normal(size=(BATCH, 16)).astype(np.float32)
    try:
        for capacity in args.scale:
            # row-wise Adagrad: 16 f32 values + 4 B state + ~70 B map and metadata per row.
            if not wait_for_memory(int(capacity * (16 * 4 + 4 + 70) * 1.25), f"scale {capacity}"):
                continue
            config = TableConfig(
                name="t",
                dim=16,
                capacity=capacity,
                initializer=InitializerConfig(kind="zeros"),  # fill speed is not measured here
                optimizer=SparseOptimizerConfig(name="rowwise_adagrad"),
            )
            stores[capacity] = EmbeddingStore([config], num_shards=args.shards)
            fill(stores[capacity], "t", capacity, f"capacity {capacity}")
            ranks[capacity] = [zipf_ranks(rng, capacity, BATCH) for _ in range(args.batches)]
        seconds = _interleaved_medians(
            {
                capacity: _lookup_apply(store, [ids_of(r) for r in ranks[capacity]], grads)
                for capacity, store in stores.items()
            },
            args.batches,
        )
        memory = {capacity: store.stats()["bytes_held"] for capacity, store in stores.items()}
    finally:
        while stores:  # no loop variable may keep a 13 GB store alive
            stores.popitem()[1].close()
        gc.collect()
    results = {}
    for capacity in seconds:
        # Context: how much numpy's own gather slows down on the same rows of a larger array.
        table = np.full((capacity, 16), 0.01, np.float32)
        numpy_lookup = median_seconds(
            lambda i, table=table, rows=ranks[capacity]: table[rows[i]], args.batches
        )
        del table
        results[capacity] = {
            "rows_per_s": BATCH / seconds[capacity],
            "numpy_lookup_rows_per_s": BATCH / numpy_lookup,
            "distinct_ids_per_batch": int(
                np.mean([len(np.unique(r)) for r in ranks[capacity][:5]])
            ),
            "bytes_held": memory[capacity],
        }
        print(f"capacity {capacity}: {json.dumps(_rounded(results[capacity]))}", file=sys.stderr)
    return results


def bench_tiered(args, rng) -> dict:
    """The same table tiered (RAM budget = half its rows) and in RAM, batches alternating."""
    rows = args.tiered_rows
    base = TableConfig(
        name="t",
        dim=16,
        capacity=rows,
        optimizer=SparseOptimizerConfig(name="adagrad", learning_rate=0.01),
    )
    if not wait_for_memory(rows * 600, "tiered"):
        return {}
    ranks = [zipf_ranks(rng, rows, BATCH) for _ in range(args.batches)]
    ids = [ids_of(r) for r in ranks]
    grads = rng.normal(size=(BATCH, 16)).astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as cold:
        tiering = TieringConfig(ram_rows=rows // 2, path=cold, chunk_rows=args.chunk_rows)
        configs = {"in_ram": base, "tiered": dataclasses.replace(base, tiering=tiering)}
        stores = {name: EmbeddingStore([c], num_shards=args.shards) for name, c in configs.items()}
        try:
            fills = {
                name: fill(store, "t", rows, name, chunk=max(1, rows // 8))
                for name, store in stores.items()
            }
            before = {name: store.stats() for name, store in stores.items()}

            seconds = _interleaved_medians(
                {name: _lookup_apply(store, ids, grads) for name, store in stores.items()},
                args.batches,
            )
            after = {name: store.stats() for name, store in stores.items()}
        finally:
            while stores:
                stores.popitem()[1].close()
    results = {}
    timed = args.batches + 1  # with the warm-up batch
    for name in seconds:
        results[name] = {
            "rows_per_s": BATCH / seconds[name],
            "fill_seconds": fills[name],
            **{
                f"{key}_per_batch": (after[name].get(key, 0) - before[name].get(key, 0)) / timed
                for key in ("cold_reads", "cold_writes")
            },
            "compactions": after[name].get("compactions", 0),
        }
        print(f"tiered {name}: {json.dumps(_rounded(results[name]))}", file=sys.stderr)
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
    parser.add_argument("--chunk-rows", type=int, default=4096, help="cold-tier chunk rows")
    parser.add_argument(
        "--only", choices=["dims", "scale", "tiered"], nargs="+", help="run only these parts"
    )
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
    parts = set(args.only or ["dims", "scale", "tiered"])
    dims = bench_dims(args, rng) if "dims" in parts else {}
    scale = bench_scale(args, rng) if "scale" in parts else {}
    tiered = bench_tiered(args, rng) if "tiered" in parts else {}
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
