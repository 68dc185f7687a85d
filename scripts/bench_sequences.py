"""Sequence training speed: the hybrid loop over packed histories against the dense step
alone at the same shapes, on a generated event log with a large item table in the host
store.

For each model (the `hstu` preset, a wider HSTU: 4 blocks, d 256, the preset with its
item table on the devices, `hstu_device`, or a hot-row cache of 100k of its rows there,
`hstu_cache`, and the preset with the jax.numpy attention in place of the Pallas kernel a
GPU's "auto" picks, `hstu_reference`):
1. `hybridrec generate --events` (--users, --items, --mean-events, histories of at most
   --longest events, all kept) and `preprocess`, cached under --cache;
2. an embedding store holding a row for each of the --items items (admitted by lookups
   before training), then `Trainer.fit` for --steps steps: positions trained per second
   between the first and the last log record (compiles excluded), the padding fraction,
   and where a step's time goes (the loop's wait / step / device / update ms);
3. the dense step alone on one of those batches, its rows already on the devices, and
   its FLOP/s (XLA's cost analysis of the compiled step) against a plain jitted matmul of
   the same FLOPs on the same machine (`hstu_device`, `hstu_cache`: the same step as
   `hstu`'s, its rows handed in, so their loops are compared with the dense step the host
   store's loop feeds);
4. with --evaluate N: the trained model's test HR@10 under full ranking over N batches
   of the test split (the same seed, data and steps for every model: the kernel's run and
   the reference attention's should land on the same figure).

    python scripts/bench_sequences.py                        # 1M items, 20k users
    python scripts/bench_sequences.py --items 20000 --users 2000 --steps 30 --models hstu

The last line is one JSON object: tokens_per_s, dense_tokens_per_s, loop_over_dense,
padding_fraction, flops_over_matmul, peak_rss_gb (the first model's), store_rows, per
model its own figures under "models" (with --evaluate, hr10_test; and hr10_test_hstu,
hr10_test_hstu_reference and their difference hr10_test_gap at the top), and hr10_sports, ndcg10_sports, hr10_toys,
ndcg10_toys from --quality (the last line of scripts/quality_sequences.py; null without).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = {
    "hstu": [],
    "hstu_wide": ["model.sequence.blocks=4", "model.sequence.heads=4", "embedding.dim=256"],
    # the preset with the item table on the devices (gathered and updated in the step)
    "hstu_device": ["embedding.placement.item=device"],
    # and with a hot-row cache of 100k of its 1M rows on the devices, the rest from the host
    "hstu_cache": ["embedding.placement.item=cache:100000"],
    # the preset with the jax.numpy attention (a GPU's "auto" is the Pallas kernel)
    "hstu_reference": ["model.sequence.attention=reference"],
}


def dataset(args) -> Path:
    """The generated log, preprocessed (cached by its arguments)."""
    name = f"events_u{args.users}_i{args.items}_m{args.mean_events}_l{args.longest}"
    root = Path(args.cache) / name
    if (root / "data" / "_SUCCESS").exists():
        return root / "data"
    command = [sys.executable, "-m", "hybridrec"]
    subprocess.run(
        [
            *command, "generate", "--events", "-o", str(root / "raw"), "--users", str(args.users),
            "--items", str(args.items), "--mean-events", str(args.mean_events),
            "--max-events", str(args.longest), "--topics", "200",
        ],
        check=True, cwd=REPO,
    )  # fmt: skip
    spec = root / "raw" / "events.toml"
    text = spec.read_text().replace("max_length = 200", f"max_length = {args.longest}")
    spec.write_text(text)
    subprocess.run(
        [*command, "preprocess", "-i", str(root / "raw" / "events.csv"), "--spec", str(spec),
         "-o", str(root / "data")],
        check=True, cwd=REPO,
    )  # fmt: skip
    return root / "data"


def fill_store(job, count: int):
    """An embedding store of the job's tables holding `count` item rows: the training
    split's items and, past them, further ids of the item table (admitted by lookups)."""
    import numpy as np
    from hybridrec.embedding_store import EmbeddingStore
    from hybridrec.training.run_store import default_local_shards

    store = EmbeddingStore(list(job.tables.tables), num_shards=default_local_shards())
    items = job.catalogue.items
    extra = max(count - len(items), 0)
    prefix = int(items[0]) & ~((1 << 56) - 1) if len(items) else 0
    ids = np.concatenate([items, prefix + (1 << 55) + np.arange(extra, dtype=np.uint64)])
    for start in range(0, len(ids), 200_000):
        chunk = ids[start : start + 200_000]
        store.lookup_features(
            {"item": chunk}, feature_tables=job.tables.feature_tables, train=True
        ).result()
    return store


def loop_figures(run_dir: Path) -> dict:
    """Positions per second between the first and the last train record, and the last
    record's split of a step's time."""
    records = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"kind": "train"' in line
    ]
    first, last = records[0], records[-1]  # the first record's interval holds the compiles
    seconds = last["time"] - first["time"]  # nothing but training between them
    return {
        "tokens_per_s": (last["tokens"] - first["tokens"]) / seconds,
        "padding_fraction": last["padding_fraction"],
        "step_time_ms": {
            key: last[key]
            for key in ("wait_ms", "step_ms", "device_ms", "update_ms")
            if key in last
        },
    }


def dense_figures(job, store, repeats: int) -> dict:
    """The dense step alone on one training batch: positions per second and FLOP/s, and a
    plain matmul's FLOP/s of about the step's FLOPs."""
    import jax
    import jax.numpy as jnp
    from hybridrec.training.layouts import SequenceLayout

    reader, _ = job.reader(job.config.data.train_split, batch_size=0, train=True)
    batch = next(reader.batches(num_batches=1))
    embeddings = (
        store.lookup_features(batch.ids, feature_tables=job.tables.feature_tables, train=False)
        .result()
        .embeddings
    )
    layout = SequenceLayout(job.mesh, ranking=job.config.model.sequence.ranking)
    device_batch = layout.device_batch(batch, embeddings)
    step, state = job.train_step(), job.new_state()
    compiled = step.lower(state, device_batch).compile()
    flops = float((compiled.cost_analysis() or {}).get("flops", 0.0))
    for _ in range(3):
        state, metrics, grads = step(state, device_batch)
    jax.block_until_ready(grads)
    started = time.perf_counter()
    for _ in range(repeats):
        state, metrics, grads = step(state, device_batch)
    jax.block_until_ready(grads)
    seconds = (time.perf_counter() - started) / repeats
    side = max(int(round((flops / 2) ** (1 / 3))), 64)
    a = jnp.ones((side, side), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    jax.block_until_ready(matmul(a))
    started = time.perf_counter()
    for _ in range(repeats):
        out = matmul(a)
    jax.block_until_ready(out)
    matmul_seconds = (time.perf_counter() - started) / repeats
    step_flops_per_s = flops / seconds
    matmul_flops_per_s = 2 * side**3 / matmul_seconds
    return {
        "dense_tokens_per_s": batch.tokens / seconds,
        "dense_step_ms": round(seconds * 1e3, 3),
        "step_gflop": round(flops / 1e9, 3),
        "step_gflop_per_s": round(step_flops_per_s / 1e9, 2),
        "matmul_gflop_per_s": round(matmul_flops_per_s / 1e9, 2),
        "flops_over_matmul": step_flops_per_s / matmul_flops_per_s,
    }


def bench_model(name: str, data: Path, args) -> dict:
    from hybridrec.training.config import load_config
    from hybridrec.training.evaluate import evaluate
    from hybridrec.training.tasks import prepare
    from hybridrec.training.trainer import Trainer

    keys = [
        f"data.path={json.dumps(str(data))}",
        f"data.max_steps={args.steps}",
        f"data.token_budget={args.token_budget}",
        f"log.every_steps={max(args.steps // 10, 1)}",
        "eval.every_steps=0",
        "embedding.capacity=4000000",
        # the shape docs/benchmarks.md measures (the HSTU preset's before its history length
        # became the dataset's): rows of 200 positions, 2 blocks
        "model.sequence.max_length=200",
        "model.sequence.blocks=2",
        *MODELS[name],
    ]
    config = load_config("hstu", keys)
    with tempfile.TemporaryDirectory() as tmp:
        store = fill_store(prepare(config), args.items)
        trainer = Trainer(config, Path(tmp) / "run", quiet=True, store=store)
        # the speed of training only: no evaluation, not even at the end
        trainer.schedule = dataclasses.replace(trainer.schedule, evaluates=False)
        trainer.fit()
        rows = store.stats()["rows"]
        figures = loop_figures(Path(tmp) / "run")
        if trainer.device_rows is not None:  # the item rows on the devices (a cache's hits)
            figures["cache_hit_rate"] = trainer.device_rows.summary().get("cache_hit_rate")
        if args.evaluate and trainer.device_rows is None:  # the trained rows in the store
            job = trainer.job
            results = evaluate(
                job, trainer.state, store, job.eval_step(), split="test", max_batches=args.evaluate
            )
            figures["hr10_test"] = results["hr@10"]
        dense_keys = [key for key in keys if not key.startswith("embedding.placement")]
        dense_job = trainer.job if dense_keys == keys else prepare(load_config("hstu", dense_keys))
        figures |= dense_figures(dense_job, store, args.repeats)
        store.close()
    figures["loop_over_dense"] = figures["tokens_per_s"] / figures["dense_tokens_per_s"]
    figures["store_rows"] = rows
    figures["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"[bench_sequences] {name}: {figures['tokens_per_s']:,.0f} positions/s in the loop, "
        f"{figures['dense_tokens_per_s']:,.0f} in the dense step alone "
        f"({figures['loop_over_dense']:.2f}), padding {figures['padding_fraction']:.1%}, "
        f"{figures['step_gflop_per_s']} GFLOP/s vs matmul {figures['matmul_gflop_per_s']} "
        f"({figures['flops_over_matmul']:.2f}), {rows:,} rows in the store",
        file=sys.stderr,
        flush=True,
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=20_000)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--mean-events", type=float, default=100)
    parser.add_argument("--longest", type=int, default=10_000, help="events of the longest history")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--cache", default="/tmp/hybridrec-bench-sequences")
    parser.add_argument("--quality", type=Path, help="the output of scripts/quality_sequences.py")
    parser.add_argument(
        "--evaluate", type=int, default=0, help="test batches to evaluate each model on (0: none)"
    )
    args = parser.parse_args()
    data = dataset(args)
    models = {name: bench_model(name, data, args) for name in args.models}
    first = models[args.models[0]]
    quality = {}
    if args.quality:
        quality = json.loads(args.quality.read_text().strip().splitlines()[-1])
    result = {
        key: first[key]
        for key in (
            "tokens_per_s", "dense_tokens_per_s", "loop_over_dense", "padding_fraction",
            "flops_over_matmul", "peak_rss_gb", "store_rows",
        )
    }  # fmt: skip
    for name in ("hstu", "hstu_reference"):
        if "hr10_test" in models.get(name, {}):
            result[f"hr10_test_{name}"] = models[name]["hr10_test"]
    if "hr10_test_hstu" in result and "hr10_test_hstu_reference" in result:
        result["hr10_test_gap"] = result["hr10_test_hstu"] - result["hr10_test_hstu_reference"]
    for dataset_name in ("sports", "toys"):
        for metric in ("hr10", "ndcg10"):
            result[f"{metric}_{dataset_name}"] = quality.get(f"{metric}_{dataset_name}_hstu")
    print(json.dumps({**result, "models": models}))


if __name__ == "__main__":
    main()
