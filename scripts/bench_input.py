"""The training input's rate: `training.data.input.ParquetReader` alone, batches of a
preprocessed click-log dataset as the trainer reads them (shuffled windows, static
batches), for each number of window-reading threads (`data.read_threads`).

Once a device table's ids are mapped in the step (`embedding.map_ids`), the reader is
the host's largest per-batch stage: at batch 16,384 a dense step of 0.87 ms (criteo_dlrm
on one H200) needs about a batch a millisecond from it. Each thread count reads
--epochs passes of the train split after one warm batch, the consumer (this process's
main thread) taking every batch as the trainer's input thread does.

The data is `hybridrec generate` rows preprocessed by `hybridrec preprocess`, cached
under --cache as `bench_gpu` caches its own (the same --cache, --rows, --seed and
--eval-fraction reuse `bench_gpu`'s files), or --data, a preprocessed dataset.

    python scripts/bench_input.py                                  # 2M rows, 1/2/4/8 threads
    python scripts/bench_input.py --data runs/criteo --batch-size 4096 --threads 1 2

The last line is one JSON object: per thread count T, reader_ms_tT (a batch's time) and
rows_per_s_tT; reader_ms (the best of them), rows_per_s, best_threads, batch_size, the
dataset's rows, the machine's cpus and the reader's default thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench_criteo import REPO, _dataset, _fail
from bench_gpu import _raw_data
from hybridrec.pipeline import read_metadata
from hybridrec.training.data.input import ParquetReader, default_read_threads


def _measure(data: Path, batch_size: int, threads: int, epochs: int, buffer: int) -> dict:
    metadata = read_metadata(data)
    reader = ParquetReader.of_dataset(
        metadata,
        metadata.split_files("train"),
        batch_size=batch_size,
        seed=0,
        shuffle_buffer=buffer,
        read_threads=threads,
    )
    total = 1 + epochs * reader.batches_per_epoch
    batches = reader.batches(num_batches=total)
    next(batches)  # the first window, read while nothing is ahead yet
    start = last = time.perf_counter()
    for count, _ in enumerate(batches, 1):
        now = time.perf_counter()
        if now - last > 2 or count == total - 1:
            rate = count * batch_size / (now - start)
            eta = (total - 1 - count) * batch_size / rate
            print(f"  [{threads} threads] {count}/{total - 1} batches  {rate / 1e6:.2f}M rows/s  ETA {eta:.0f}s", flush=True)  # fmt: skip
            last = now
    seconds = time.perf_counter() - start
    return {"ms": 1000 * seconds / (total - 1), "rows_per_s": (total - 1) * batch_size / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="a preprocessed click-log dataset")
    parser.add_argument("--rows", type=int, default=2_000_000, help="generated rows")
    parser.add_argument("--cardinality-scale", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0, help="of the generated data")
    parser.add_argument("--eval-fraction", type=float, default=0.01, help="rows held out")
    parser.add_argument("--cache", type=Path, default=REPO / "runs" / "bench_gpu")
    parser.add_argument("--batch-size", type=int, default=16384)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--epochs", type=int, default=1, help="passes timed per thread count")
    parser.add_argument("--shuffle-buffer", type=int, default=131072, help="data.shuffle_buffer")
    args = parser.parse_args()
    if min(args.threads) < 1:
        _fail(f"--threads {args.threads}: each count must be >= 1")
    if args.data is None:
        raw = _raw_data(args.cache, args.rows, args.seed, args.cardinality_scale)
        args.data = _dataset([raw], args.cache, ("--eval-fraction", str(args.eval_fraction)))
    elif not (args.data / "metadata.json").exists():
        _fail(f"--data {args.data}: no metadata.json (not a `hybridrec preprocess` output)")
    rows = read_metadata(args.data).split_rows("train")
    print(f"data: {args.data} ({rows:,} train rows), batch {args.batch_size}", flush=True)
    summary: dict = {"batch_size": args.batch_size, "rows": rows, "cpus": os.cpu_count()}
    summary["default_threads"] = default_read_threads()
    best = None
    for threads in args.threads:
        result = _measure(args.data, args.batch_size, threads, args.epochs, args.shuffle_buffer)
        summary[f"reader_ms_t{threads}"] = round(result["ms"], 3)
        summary[f"rows_per_s_t{threads}"] = round(result["rows_per_s"])
        print(f"{threads} threads: {result['ms']:.2f} ms a batch, {result['rows_per_s'] / 1e6:.2f}M rows/s", flush=True)  # fmt: skip
        if best is None or result["ms"] < best[1]["ms"]:
            best = (threads, result)
    summary.update(
        reader_ms=round(best[1]["ms"], 3),
        rows_per_s=round(best[1]["rows_per_s"]),
        best_threads=best[0],
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
