"""`hybridrec quickstart`: the whole job on a built-in default, end to end.

generate (synthetic Criteo-format logs) → preprocess (Apache Beam) → train (hybrid
loop, in-process embedding shards, on the devices JAX sees) → evaluate the final
checkpoint → plot → summary. With `--input` it preprocesses real Criteo files
(Kaggle `train.txt`, 1TB `day_N`, `.gz` or not) instead of generating data.

Everything goes under `--out` (default runs/quickstart): `raw/`, `data/`, `run/`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from hybridrec import _flags, evaluate, generate, plot, preprocess, train

DEFAULT_ROWS = 1_000_000


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

    total = time.perf_counter() - started
    stages = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in timings.items())
    print(
        f"\nquickstart finished in {total:.0f} s ({stages})\n"
        f"  data      {data}  (metadata.json, train/ and eval/ Parquet)\n"
        f"  run       {run_dir}  (summary.json, metrics.jsonl, tensorboard/, checkpoints/)\n"
        f"  curves    {run_dir / 'plots' / 'curves.png'}\n"
        f"  next      tensorboard --logdir {run_dir / 'tensorboard'}   |   "
        f"hybridrec train --config criteo_dlrm --data DIR --run-dir runs/criteo",
        flush=True,
    )
    return 0
