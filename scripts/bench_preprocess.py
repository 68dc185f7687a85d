"""Benchmark: rows/s of the Beam preprocessing job vs a single-process baseline.

Both do the same work on the same input: parse + validate, hash categoricals,
transform dense, split, write zstd Parquet with 64k-row groups, and compute the
statistics. The baseline calls the library functions in a plain loop in this process,
no Beam, counting lines in a first pass (the Beam job learns the counts while parsing
and splits the one chunk holding the eval boundary afterwards); the Beam job runs on
the DirectRunner as `hybridrec preprocess` runs it by default (in_memory mode, one
worker, a thread, per core for an input of several chunks and 64 MB or more, else one),
for comparison in multi_processing and multi_threading mode (one worker per core) and in
in_memory mode with one worker, and on Dask with 2 worker processes: a local cluster the
job starts and stops (`--runner dask`, start-up included) and an already running cluster
(`--dask-address`).

    python scripts/bench_preprocess.py                 # 1M generated rows (+ the real sample if present)
    python scripts/bench_preprocess.py --rows 2000000

The last line of output is one JSON object:
{"beam_rows_per_s", "baseline_rows_per_s", "ratio", "dask_rows_per_s",
"dask_over_direct", "dask_identical"} for the generated data: the default
DirectRunner (in_memory, a thread per core) against the baseline and Dask (local
cluster, 2 workers) against that DirectRunner; `dask_identical` is true when both Dask runs wrote
exactly what the DirectRunner wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
from distributed import LocalCluster
from hybridrec.pipeline import BlockParser, PartialStats, PreprocessConfig, load_spec

from hybridrec import pipeline

DASK_WORKERS = 2

REAL_SAMPLE = (
    Path(__file__).resolve().parents[1].parent / "shared/data/criteo_kaggle_sample/train.tsv.gz"
)


def baseline(path: Path, out: Path, chunk_mb: float = 32.0, block_mb: float = 16.0) -> float:
    """Single process, no Beam: the same per-chunk functions in a loop. Returns seconds."""
    start = time.perf_counter()
    spec = load_spec("criteo")
    parser = BlockParser(spec)
    chunks = pipeline.list_chunks([str(path)], int(chunk_mb * 2**20))
    block_bytes = int(block_mb * 2**20)
    counts = [pipeline.count_lines(chunk, block_bytes) for chunk in chunks]
    total = sum(counts)
    split = pipeline.SplitRule("position", 0.1, total - round(total * 0.1))
    stats = PartialStats()
    first = 0
    for chunk, lines in zip(chunks, counts, strict=True):
        partial, _ = pipeline.process_chunk(
            chunk,
            spec=spec,
            parser=parser,
            first_line=first,
            global_first_line=first,
            split=split,
            temp_dir=str(out),
            block_bytes=block_bytes,
        )
        stats.merge(partial)
        first += lines
    stats.to_json(spec)
    return time.perf_counter() - start


def beam_run(path: Path, out: Path, mode: str | None = None, workers: int | None = None) -> float:
    """The DirectRunner in `mode` with `workers` (None: the defaults for the input)."""
    config = PreprocessConfig(inputs=[str(path)], output=str(out), overwrite=True)
    flags = [f"--direct_running_mode={mode}"] if mode else []
    if workers is not None:
        flags.append(f"--direct_num_workers={workers}")
    start = time.perf_counter()
    pipeline.run_preprocess(config, beam_args=flags, quiet=True)
    return time.perf_counter() - start


def dask_run(path: Path, out: Path, address: str | None = None) -> float:
    """The DaskRunner with 2 worker processes: a local cluster started (and stopped) by the
    job, as `--runner dask` does, or the running cluster at `address`."""
    config = PreprocessConfig(
        inputs=[str(path)],
        output=str(out),
        overwrite=True,
        runner="dask",
        dask_workers=DASK_WORKERS,
        dask_address=address,
    )
    start = time.perf_counter()
    pipeline.run_preprocess(config, quiet=True)
    return time.perf_counter() - start


def same_output(first: Path, second: Path) -> bool:
    """Same metadata (but the runner line), same Parquet tables, same rejected rows."""
    metas = [json.loads((out / "metadata.json").read_text()) for out in (first, second)]
    for meta in metas:
        meta.pop("runner")
    if metas[0] != metas[1]:
        return False
    meta = metas[0]
    for name in meta["splits"]["train"]["files"] + meta["splits"]["eval"]["files"]:
        if not pq.read_table(first / name).equals(pq.read_table(second / name)):
            return False
    return all(
        (first / n).read_bytes() == (second / n).read_bytes() for n in meta["rejected_files"]
    )


def _timed(function, *args) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process and its finished children)."""
    before = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter()
    function(*args)
    wall = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = sum(
        a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime
        for a, b in zip(after, before, strict=True)
    )
    return wall, cpu


def measure(path: Path, rows: int, work: Path, label: str, repeats: int, address: str) -> dict:
    """Best of `repeats` runs of each variant (the CPU may be shared with other work)."""
    variants = {
        "baseline": lambda: baseline(path, work / "base"),
        # the default: in_memory, one worker (a thread) per core for a large input
        "beam_default": lambda: beam_run(path, work / "beam-th"),
        "beam_multi_processing": lambda: beam_run(path, work / "beam-mp", "multi_processing"),
        "beam_multi_threading": lambda: beam_run(path, work / "beam-mt", "multi_threading"),
        "beam_in_memory": lambda: beam_run(path, work / "beam-mem", "in_memory", 1),
        "dask_local_cluster": lambda: dask_run(path, work / "dask"),
        "dask_running_cluster": lambda: dask_run(path, work / "dask-running", address),
    }
    result = {"input": label, "rows": rows}
    for name, run in variants.items():
        runs = []
        for _ in range(repeats):
            shutil.rmtree(work / "base", ignore_errors=True)
            runs.append(_timed(run))
        wall, cpu = min(runs)
        result[f"{name}_rows_per_s"] = rows / wall
        result[f"{name}_cpu_s"] = cpu
        result[f"{name}_wall_s"] = wall
    for mode in ("default", "multi_processing", "multi_threading", "in_memory"):
        result[f"ratio_{mode}"] = result[f"beam_{mode}_rows_per_s"] / result["baseline_rows_per_s"]
    direct = result["beam_default_rows_per_s"]
    result["dask_over_direct"] = result["dask_local_cluster_rows_per_s"] / direct
    result["dask_running_over_direct"] = result["dask_running_cluster_rows_per_s"] / direct
    result["dask_identical"] = same_output(work / "beam-th", work / "dask") and same_output(
        work / "beam-th", work / "dask-running"
    )
    result["modes_identical"] = all(
        same_output(work / "beam-th", work / other) for other in ("beam-mp", "beam-mt", "beam-mem")
    )
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="generated rows")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per variant; the best counts")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_preprocess_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"cores={os.cpu_count()} load average={os.getloadavg()} workdir={work}")
    data = work / "generated.tsv"
    if not data.exists():
        pipeline.generate(data, args.rows, seed=0)
    with LocalCluster(
        n_workers=DASK_WORKERS, threads_per_worker=1, host="127.0.0.1", dashboard_address=":0"
    ) as cluster:
        address = cluster.scheduler_address
        label = f"generated {args.rows} rows (TSV)"
        generated = measure(data, args.rows, work, label, args.repeats, address)
        if REAL_SAMPLE.exists():
            label = "real Criteo sample (one .gz file)"
            measure(REAL_SAMPLE, 137_139, work, label, args.repeats, address)
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    beam = generated["beam_default_rows_per_s"]
    base = generated["baseline_rows_per_s"]
    print(
        json.dumps(
            {
                "beam_rows_per_s": round(beam),
                "baseline_rows_per_s": round(base),
                "ratio": round(beam / base, 3),
                "dask_rows_per_s": round(generated["dask_local_cluster_rows_per_s"]),
                "dask_over_direct": round(generated["dask_over_direct"], 3),
                "dask_identical": generated["dask_identical"],
            }
        )
    )


if __name__ == "__main__":
    main()
