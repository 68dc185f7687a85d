"""Training throughput: hybrid (k = 4) vs synchronous (k = 0) vs the dense step alone.

In one run, on the same generated data and the same model (the Criteo DLRM shape,
8-device CPU mesh, in-process embedding shards):

  (a) samples/s of the hybrid trainer end to end, staleness bound k = 4;
  (b) the same with k = 0 (every lookup waits for the previous update);
  (c) the jitted dense step alone on embeddings already on the devices: the limit
      where embeddings cost nothing.

Steady state only: the first log interval (compilation) is left out of (a) and (b),
the first steps out of (c). The three run interleaved `--repeats` times and the best
rate of each counts (the machine may be shared). Last line: one JSON object.

    python scripts/bench_train.py [--rows 400000] [--steps 60] [--batch 4096]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def _steady_rate(run_dir: Path) -> float:
    """Samples/s over every log interval but the first (which includes compilation)."""
    from hybridrec.training.run_log import read_records

    train = [r for r in read_records(run_dir) if r["kind"] == "train"]
    samples = seconds = 0.0
    for previous, record in zip(train, train[1:], strict=False):
        interval = record["samples"] - previous["samples"]
        samples += interval
        seconds += interval / record["samples_per_s"]
    return samples / seconds


def train_rate(data: Path, out: Path, *, k: int, steps: int, batch: int, extra: list[str]) -> float:
    """Steady-state samples/s of `hybridrec train` with staleness bound k."""
    from hybridrec.common import config as config_lib
    from hybridrec.training.config import PRESET_DIR, TrainConfig
    from hybridrec.training.trainer import Trainer

    run_dir = out / f"run_k{k}"
    shutil.rmtree(run_dir, ignore_errors=True)
    config = config_lib.load(
        TrainConfig,
        "criteo_dlrm",
        [
            f'data.path="{data}"',
            f"data.batch_size={batch}",
            f"data.max_steps={steps}",
            f"hybrid.staleness={k}",
            "log.every_steps=5",
            "checkpoint.every_steps=0",
            "eval.every_steps=0",
            *extra,
        ],
        preset_dir=PRESET_DIR,
    )
    Trainer(config, run_dir, quiet=True).fit()
    rate = _steady_rate(run_dir)
    print(f"  k={k}: {rate:,.0f} samples/s (steady state, {steps} steps of {batch})", flush=True)
    return rate


def dense_only_rate(data: Path, *, steps: int, batch: int, extra: list[str]) -> float:
    """Samples/s of the jitted dense step alone, inputs already on the devices."""
    import jax
    import numpy as np
    from hybridrec.common import config as config_lib
    from hybridrec.model import create_train_state, make_global_batch, make_mesh, make_train_step
    from hybridrec.pipeline import read_metadata
    from hybridrec.training.config import PRESET_DIR, TrainConfig

    config = config_lib.load(
        TrainConfig, "criteo_dlrm", [f"data.batch_size={batch}", *extra], preset_dir=PRESET_DIR
    )
    metadata = read_metadata(data)
    mesh = make_mesh(config.mesh)
    num_dense, num_features = len(metadata.dense_columns), len(metadata.categorical)
    state = create_train_state(
        config.model,
        config.optimizer,
        mesh,
        jax.random.key(0),
        num_dense=num_dense,
        num_features=num_features,
        embedding_dim=config.embedding.dim,
    )
    step = make_train_step(mesh)
    rng = np.random.default_rng(0)
    batches = [
        make_global_batch(
            {
                "embeddings": rng.normal(
                    0, 0.01, (batch, num_features, config.embedding.dim)
                ).astype(np.float32),
                "dense": rng.random((batch, num_dense), np.float32),
                "labels": (rng.random(batch) < 0.25).astype(np.float32),
            },
            mesh,
        )
        for _ in range(4)
    ]
    warmup = 3
    for i in range(warmup):
        state, metrics, grads = step(state, batches[i % 4])
    jax.block_until_ready((state, grads))
    start = time.perf_counter()
    for i in range(steps):
        state, metrics, grads = step(state, batches[i % 4])
        # one step in flight, as in the trainer (which needs each step's gradients); many
        # queued collective steps can also starve XLA's CPU rendezvous on a 2-core machine
        jax.block_until_ready(grads)
    jax.block_until_ready(state)
    rate = steps * batch / (time.perf_counter() - start)
    print(f"  dense step only: {rate:,.0f} samples/s ({steps} steps of {batch})", flush=True)
    return rate


def prepare_data(out: Path, rows: int) -> Path:
    """Generated Criteo-format data, preprocessed once and reused by later runs."""
    from hybridrec.cli import run

    data = out / "data"
    marker = out / f"rows-{rows}"
    if (data / "_SUCCESS").exists() and marker.exists():
        return data
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "raw.tsv"
    if run("generate", ["--output", str(raw), "--rows", str(rows), "--seed", "1"]):
        sys.exit("generate failed")
    if run("preprocess", ["--input", str(raw), "--output", str(data), "--overwrite", "--quiet"]):
        sys.exit("preprocess failed")
    raw.unlink()
    for old in out.glob("rows-*"):
        old.unlink()
    marker.touch()
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=400_000, help="generated rows")
    parser.add_argument("--steps", type=int, default=60, help="training steps per mode")
    parser.add_argument("--batch", type=int, default=4096, help="global batch size")
    parser.add_argument("--out", default="runs/bench_train", help="work directory")
    parser.add_argument(
        "--repeats", type=int, default=2, help="rounds; the best of each mode counts"
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="extra config overrides"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    data = prepare_data(out, args.rows)
    print(f"data: {data}; model: criteo_dlrm preset; batch {args.batch}", flush=True)
    rates: dict[str, list[float]] = {"hybrid": [], "sync": [], "dense": []}
    for _ in range(args.repeats):  # interleaved, so slow phases of a shared machine hit all three
        common = dict(steps=args.steps, batch=args.batch, extra=args.overrides)
        rates["hybrid"].append(train_rate(data, out, k=4, **common))
        rates["sync"].append(train_rate(data, out, k=0, **common))
        rates["dense"].append(dense_only_rate(data, **common))
    hybrid, sync, dense = (max(rates[mode]) for mode in ("hybrid", "sync", "dense"))
    print(f"best of {args.repeats}: " + ", ".join(f"{m} {max(r):,.0f}" for m, r in rates.items()))
    result = {
        "hybrid_samples_per_s": round(hybrid, 1),
        "sync_samples_per_s": round(sync, 1),
        "dense_only_samples_per_s": round(dense, 1),
        "hybrid_over_dense_only": round(hybrid / dense, 3),
        "hybrid_over_sync": round(hybrid / sync, 3),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
