"""A hot-row cache's admission and eviction per batch, at the cache sizes a GPU holds.

One cache (`training.device.hot_rows.HotRows`) in front of the long-tail Criteo features (the
generator's Zipf ids, its long tail widened as `bench_gpu`'s data), driven the way
`DeviceRows` drives it on the lookup thread: per batch, the distinct ids are counted
(`seen`), admitted and evicted (`choose`), and an id -> row map follows. The cache is
filled first; then --batches-timed batches are timed. Reported per capacity: the
milliseconds of `seen` and `choose` per batch, rows admitted per batch, and the hit rate
(of the batch's lookups, the share the cache held when the batch came).

    python scripts/bench_hot_rows.py                              # 65,536 / 1M / 4M rows
    python scripts/bench_hot_rows.py --capacities 1048576 --exact # compare every row

The last line is one JSON object: per capacity C, seen_ms_cC, choose_ms_cC,
admitted_per_batch_cC and hit_rate_cC.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from bench_device_rows import feature_ids
from hybridrec.embedding_store import SlotMap, unique_inverse
from hybridrec.pipeline.synthetic import CATEGORICAL_PROFILE, LONG_TAIL, scaled_cardinality
from hybridrec.training.device.hot_rows import HotRows

LONG = [j for j, (card, _, _) in enumerate(CATEGORICAL_PROFILE) if card >= LONG_TAIL]


def _ids(rng, batch: int, scale: float) -> np.ndarray:
    """One batch's ids of the long-tail features, prefixed per feature (one fused table)."""
    return np.concatenate(
        [
            feature_ids(rng, batch, j, scaled_cardinality(CATEGORICAL_PROFILE[j][0], scale))
            for j in LONG
        ]
    )


class _Cache:
    """HotRows with the id -> row map `DeviceRows._admit` keeps beside it."""

    def __init__(self, capacity: int, cooldown: int, exact: bool):
        self.hot = HotRows(capacity, cooldown=cooldown, exact_below=capacity + 1 if exact else 0)
        self.map = SlotMap(1 << 16)
        self.ids = np.zeros(capacity, np.uint64)

    def batch(self, ids: np.ndarray) -> tuple[float, float, int, int]:
        """(seen s, choose s, lookups the cache held, rows admitted) of one batch."""
        unique, inverse = unique_inverse(ids)
        occurrences = np.bincount(inverse, minlength=len(unique))
        slots = self.map.find(unique)
        hits = int(occurrences[slots >= 0].sum())
        used = self.hot.used
        start = time.perf_counter()
        estimate = self.hot.seen(unique, occurrences)
        middle = time.perf_counter()
        admitted, rows = self.hot.choose(unique, estimate, slots)
        end = time.perf_counter()
        leaving = rows[rows < used]
        evicted = self.ids[leaving]
        self.hot.evicted(evicted)
        if len(leaving):
            self.map.remove(evicted)
        self.map.insert(unique[admitted], rows)
        self.ids[rows] = unique[admitted]
        return middle - start, end - middle, hits, len(admitted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacities", type=int, nargs="+", default=[1 << 16, 1 << 20, 1 << 22])
    parser.add_argument("--batch", type=int, default=16384, help="rows per batch")
    parser.add_argument("--batches-timed", type=int, default=10)
    parser.add_argument("--cooldown", type=int, default=4, help="the staleness bound k")
    parser.add_argument("--scale", type=float, default=10.0, help="long-tail cardinality scale")
    parser.add_argument("--max-fill", type=int, default=400, help="batches at most to fill")
    parser.add_argument("--exact", action="store_true", help="compare every held row")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out: dict[str, float] = {}
    for capacity in args.capacities:
        rng = np.random.default_rng(args.seed)
        cache = _Cache(capacity, args.cooldown, args.exact)
        fill = 0
        started = time.perf_counter()
        while cache.hot.used < capacity and fill < args.max_fill:
            cache.batch(_ids(rng, args.batch, args.scale))
            fill += 1
            if fill % 20 == 0:
                print(
                    f"  filling {capacity:,} rows: {cache.hot.used:,} after {fill} batches "
                    f"({time.perf_counter() - started:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
        if cache.hot.used < capacity:
            print(
                f"capacity {capacity:,}: not full after {fill} batches ({cache.hot.used:,} rows); "
                "timing it as it is",
                flush=True,
            )
        seen = choose = 0.0
        hits = lookups = admitted = 0
        for _ in range(args.batches_timed):
            ids = _ids(rng, args.batch, args.scale)
            a, b, held, came = cache.batch(ids)
            seen, choose = seen + a, choose + b
            hits, lookups, admitted = hits + held, lookups + len(ids), admitted + came
        n = args.batches_timed
        row = {
            f"seen_ms_c{capacity}": round(seen / n * 1e3, 2),
            f"choose_ms_c{capacity}": round(choose / n * 1e3, 2),
            f"admitted_per_batch_c{capacity}": round(admitted / n),
            f"hit_rate_c{capacity}": round(hits / max(lookups, 1), 4),
        }
        print(
            f"capacity {capacity:>10,} ({'every row' if args.exact else 'default'}): "
            f"filled in {fill} batches; per batch of {args.batch:,} rows "
            f"({len(LONG)} features): seen {row[f'seen_ms_c{capacity}']} ms, "
            f"choose {row[f'choose_ms_c{capacity}']} ms, "
            f"{row[f'admitted_per_batch_c{capacity}']:,} admitted, "
            f"hit rate {row[f'hit_rate_c{capacity}']:.4f}",
            flush=True,
        )
        out.update(row)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
