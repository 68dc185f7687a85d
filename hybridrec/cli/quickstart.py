"""`hybridrec quickstart`: the whole job on a built-in default, end to end.

generate (synthetic Criteo-format logs) → preprocess (Apache Beam) → train (hybrid
loop, in-process embedding shards, on the devices JAX sees) → evaluate the final
checkpoint → plot → summary. With `--input` it preprocesses real Criteo files
(Kaggle `train.txt`, 1TB `day_N`, `.gz` or not) instead of generating data.

Everything goes under `--out` (default runs/quickstart): `raw/`, `data/`, `run/`.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import time
from pathlib import Path

from hybridrec.cli import _flags, evaluate, export, generate, plot, preprocess, train
from hybridrec.serving import demo_score

DEFAULT_ROWS = 1_000_000


def _last_rows(path: Path, count: int) -> list[str]:
    """The last `count` lines of a (gzipped) text file."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return [line.rstrip("\n") for line in collections.deque(handle, maxlen=count)]


def _stage(title: str) -> float:
    print(f"\n== {title}", flush=True)
    return time.perf_counter()


def main(argv: list[str]) -> int:
    """`hybridrec quickstart`."""
    parser = argparse.ArgumentParser(
        prog="hybridrec quickstart",
        description="generate -> preprocess -> train -> evaluate -> summary on a built-in default",
    )
    parser.add_argument("--out", default="runs/quickstart", help="output directory")
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS, help="synthetic rows to generate")
    parser.add_argument(
        "--input",
        nargs="+",
        help="real Criteo TSV files (.gz allowed) to use instead of synthetic data",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the generator and the run")
    parser.add_argument("--config", default="quickstart", help="training preset")
    _flags.add_override_flag(parser, "override a training config key (repeatable)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    started = time.perf_counter()
    timings: dict[str, float] = {}
    if args.input:
        inputs = [str(path) for path in args.input]
    else:
        begin = _stage(f"generate {args.rows:,} synthetic Criteo-format rows")
        raw = out / "raw" / "synthetic.tsv.gz"
        raw.parent.mkdir(parents=True, exist_ok=True)
        generate.main(["--output", str(raw), "--rows", str(args.rows), "--seed", str(args.seed)])
        inputs = [str(raw)]
        timings["generate"] = time.perf_counter() - begin

    begin = _stage("preprocess (Apache Beam, DirectRunner)")
    data = out / "data"
    preprocess.main(["--input", *inputs, "--output", str(data), "--overwrite"])
    timings["preprocess"] = time.perf_counter() - begin

    begin = _stage("train (hybrid loop: async embedding store, synchronous dense step on the mesh)")
    run_dir = out / "run"
    overrides = [*args.overrides, f"seed={args.seed}"]
    train.main(
        [
            "--data",
            str(data),
            "--run-dir",
            str(run_dir),
            "--config",
            args.config,
            "--overwrite",
            *[item for override in overrides for item in ("--set", override)],
        ],
    )
    timings["train"] = time.perf_counter() - begin

    begin = _stage("evaluate the final checkpoint")
    evaluate.main(["--run", str(run_dir)])
    timings["evaluate"] = time.perf_counter() - begin
    plot.main([str(run_dir)])

    begin = _stage("export the model and score a few eval rows through `hybridrec serve`")
    exported = out / "export"
    export.main(["--run", str(run_dir), "--out", str(exported), "--precision", "int8"])
    rows = _last_rows(Path(inputs[-1]), 5)  # the last rows: in the eval split (split by position)
    for row, probability in zip(rows, demo_score(exported, rows), strict=True):
        label = row.split("\t", 1)[0]
        print(f"  label {label}  click probability {probability:.4f}")
    timings["export+serve"] = time.perf_counter() - begin

    total = time.perf_counter() - started
    stages = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in timings.items())
    print(
        f"\nquickstart finished in {total:.0f} s ({stages})\n"
        f"  data      {data}  (metadata.json, train/ and eval/ Parquet)\n"
        f"  run       {run_dir}  (summary.json, metrics.jsonl, tensorboard/, checkpoints/)\n"
        f"  curves    {run_dir / 'plots' / 'curves.png'}\n"
        f"  export    {exported}  (serve it: hybridrec serve {exported})\n"
        f"  next      tensorboard --logdir {run_dir / 'tensorboard'}   |   "
        f"hybridrec train --config criteo_dlrm --data DIR --run-dir runs/criteo",
        flush=True,
    )
    return 0
