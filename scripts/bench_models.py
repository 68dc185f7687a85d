"""Model techniques against their baselines on Criteo data: DHEN, DMT, Shampoo, learned hash.

Preprocesses the input once (the cache of scripts/bench_criteo.py), then trains the
`criteo_dlrm` preset once per technique and seed, each in a fresh `hybridrec train`
process, with the same split, batch, epochs and embedding settings; only the tower or
the dense optimizer changes:

    baseline   DLRM (the preset), Adam
    dcnv2      DCN-V2, three rank-64 cross layers and a 512-256 deep MLP, Adam
    dhen       DHEN, two layers of dot + cross + attention + MLP modules, Adam
    dhen_light DHEN without the attention module (about 1.6x its dense step speed here)
    shampoo    DLRM with blocked Shampoo grafted onto Adam (block 128, roots every 10 steps)
    dmt        DLRM over four DMT towers, each compressing its features to 2 vectors; the
               towers are proposed by the Tower Partitioner from the baseline run's
               learned embeddings (interaction strength) and lookup loads
    hashing_trick  DLRM with each feature's ids hashed into a fifth of its rows
    learned_hash   the same row budget with a map learned from the baseline run
               (`hybridrec learn-hash`: frequent ids keep rows, the tail is grouped by
               the run's embeddings); its baseline is hashing_trick at the same memory

Per technique also the jitted dense step alone (batches already on the device, whole
Shampoo refresh periods), in its own process: what the tower or optimizer costs by itself.

Training is synchronous (`hybrid.staleness = 0`) so that the runs differ only by the
technique, not by the timing of the asynchronous embedding updates. Per run: eval AUC,
logloss and normalized entropy (on the held-out split), steady samples/s (after the first
20 steps) and the dense parameter count; per technique the mean over seeds.

    python scripts/bench_models.py                         # the shared Criteo sample
    python scripts/bench_models.py --input day_0.gz --seeds 0 1 2

The last line is one JSON object: `<technique>_auc`, `<technique>_ne`, `<technique>_logloss`,
`<technique>_samples_per_s`, `<technique>_dense_step_samples_per_s`,
`<technique>_dense_params` for baseline, dcnv2, dhen, dhen_light, shampoo, dmt,
hashing_trick and learned_hash (null for a technique left out with --techniques).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import bench_criteo  # the preprocessing cache and child-process runner shared with it

REPO = Path(__file__).resolve().parent.parent
STEADY_AFTER = 20  # steps excluded from the steady rate (compilation, warm-up)
DMT_TOWERS = 4  # towers the Tower Partitioner proposes, each compressed to 2 vectors
PARTITION_ROWS = 8192  # eval examples whose learned embeddings the partitioner reads
TECHNIQUES = {
    "baseline": [],
    "dcnv2": ["model.tower=dcnv2", "model.dcnv2.low_rank=64"],
    "dhen": ["model.tower=dhen"],
    "dhen_light": ["model.tower=dhen", 'model.dhen.modules=["dot", "cross", "mlp"]'],
    "shampoo": ["optimizer.name=shampoo"],
    "dmt": ["model.tower_outputs=2"],  # + model.towers from the baseline's embeddings
    # + embedding.id_map learned from the baseline run (`hybridrec learn-hash`)
    "hashing_trick": ['embedding.id_map_kind="hashing_trick"'],
    "learned_hash": ['embedding.id_map_kind="learned"'],
}
NEEDS_BASELINE = ("dmt", "hashing_trick", "learned_hash")  # built from its first run
HASH_FRACTION = 0.2  # rows per feature of an id map, as a fraction of the feature's ids


def _dense_params(settings: list[str]) -> int:
    """Parameters of the dense tower these overrides give (13 dense, 26 x dim embeddings)."""
    import jax
    from flax import nnx
    from hybridrec.common import config as config_lib
    from hybridrec.model import build_tower
    from hybridrec.training.config import PRESET_DIR, TrainConfig

    config = config_lib.load(TrainConfig, "criteo_dlrm", settings, preset_dir=PRESET_DIR)
    tower = nnx.eval_shape(
        lambda: build_tower(
            config.model,
            num_dense=13,
            num_features=26,
            embedding_dim=config.embedding.dim,
            rngs=nnx.Rngs(0),
        )
    )
    return sum(leaf.size for leaf in jax.tree.leaves(nnx.state(tower, nnx.Param)))


def _proposed_towers(run_dir: Path, data: Path, batch: int) -> list[list[int]]:
    """The Tower Partitioner on a finished run (`training.learned.partition.propose_towers_from_run`)."""
    from hybridrec.training.learned.partition import propose_towers_from_run

    towers, features = propose_towers_from_run(
        run_dir, data, DMT_TOWERS, batch_size=batch, rows=PARTITION_ROWS
    )
    names = [[features[index] for index in tower] for tower in towers]
    print(f"== Tower Partitioner on {run_dir.name}: {names}", flush=True)
    return towers


def _learned_map(baseline_run: Path, work: Path) -> Path:
    """`hybridrec learn-hash` from the baseline run: a map into HASH_FRACTION of the rows."""
    id_map = work / f"id_map_{HASH_FRACTION:g}"
    shutil.rmtree(id_map, ignore_errors=True)
    command = [sys.executable, "-m", "hybridrec", "learn-hash", "--run", str(baseline_run)]
    command += ["--out", str(id_map), "--fraction", str(HASH_FRACTION)]
    print(f"\n== learn-hash from {baseline_run.name} (fraction {HASH_FRACTION:g})", flush=True)
    if subprocess.run(command, cwd=REPO).returncode:
        bench_criteo._fail("learn-hash failed; see the output above")
    return id_map


def _dense_step_rate(settings: list[str], batch: int, env: dict) -> float:
    """Samples/s of the technique's jitted train step alone (batches already on the device),
    over whole preconditioner periods, median of 3 rounds, in a fresh process."""
    command = [sys.executable, __file__, "--dense-child", json.dumps(settings)]
    command += ["--batch", str(batch)]
    out = subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["samples_per_s"]


def _dense_child(settings: list[str], batch: int) -> None:
    import time

    import jax
    import numpy as np
    from hybridrec.common import config as config_lib
    from hybridrec.model import create_train_state, make_global_batch, make_mesh, make_train_step
    from hybridrec.training.config import PRESET_DIR, TrainConfig

    config = config_lib.load(TrainConfig, "criteo_dlrm", settings, preset_dir=PRESET_DIR)
    mesh = make_mesh(config.mesh)
    dim = config.embedding.dim
    state = create_train_state(
        config.model, config.optimizer, mesh, 0, num_dense=13, num_features=26, embedding_dim=dim
    )
    step = make_train_step(mesh)
    rng = np.random.default_rng(0)
    batches = [
        make_global_batch(
            {
                "embeddings": rng.normal(0, 0.01, (batch, 26, dim)).astype(np.float32),
                "dense": rng.random((batch, 13)).astype(np.float32),
                "labels": (rng.random(batch) < 0.25).astype(np.float32),
            },
            mesh,
        )
        for _ in range(2)
    ]
    steps = 2 * config.optimizer.shampoo_precondition_every  # whole refresh periods
    for index in range(steps):  # compiles both branches of a refresh
        state, metrics, grads = step(state, batches[index % 2])
    jax.block_until_ready((state, metrics, grads))
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        for index in range(steps * 2):
            state, metrics, grads = step(state, batches[index % 2])
        jax.block_until_ready((state, metrics, grads))
        rates.append(batch * steps * 2 / (time.perf_counter() - start))
    print(json.dumps({"samples_per_s": float(np.median(rates))}))


def _train(data: Path, name: str, settings: list[str], seed: int, args, env) -> dict:
    run_dir = args.cache / "model_runs" / f"{name}_seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "hybridrec", "train", "--config", "criteo_dlrm"]
    command += ["--data", str(data), "--run-dir", str(run_dir), "--quiet"]
    overrides = [
        f"data.batch_size={args.batch}",
        f"data.epochs={args.epochs}",
        "hybrid.staleness=0",
        f"seed={seed}",
        "log.every_steps=10",
        "log.tensorboard=false",
        *settings,
    ]
    for setting in overrides:
        command += ["--set", setting]
    print(f"\n== {name}, seed {seed}: {' '.join(settings) or 'the criteo_dlrm preset'}", flush=True)
    seconds, _, code = bench_criteo._run_child(command, env)
    if code:
        bench_criteo._fail(f"training {name} (seed {seed}) failed (exit {code}); see above")
    summary = json.loads((run_dir / "summary.json").read_text())
    train = [
        record
        for record in map(json.loads, (run_dir / "metrics.jsonl").open())
        if record["kind"] == "train"
    ]
    first = next((r for r in train if r["step"] >= STEADY_AFTER), train[0])
    last = train[-1]
    if last["step"] > first["step"]:
        steady = (last["samples"] - first["samples"]) / (last["time"] - first["time"])
    else:
        steady = last["samples_per_s"]
    result = {
        "auc": summary["eval"]["auc"],
        "logloss": summary["eval"]["logloss"],
        "ne": summary["eval"]["ne"],
        "samples_per_s": steady,
    }
    print(
        f"   AUC {result['auc']:.4f}, logloss {result['logloss']:.4f}, NE {result['ne']:.4f}, "
        f"steady {steady:,.0f} samples/s ({seconds:.0f} s in all)",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", type=Path, help="Criteo-format files")
    parser.add_argument("--cache", type=Path, default=REPO / "runs" / "bench_criteo")
    parser.add_argument("--batch", type=int, default=512, help="global batch of every run")
    parser.add_argument("--epochs", type=int, default=1, help="epochs of every run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument(
        "--techniques", nargs="+", choices=list(TECHNIQUES), default=list(TECHNIQUES)
    )
    parser.add_argument("--dense-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dense_child:
        _dense_child(json.loads(args.dense_child), args.batch)
        return
    inputs = bench_criteo.checked_inputs(args.input)
    parameters = {
        name: _dense_params(TECHNIQUES[name]) for name in args.techniques if name != "dmt"
    }
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the trainer's own device layout
    data = bench_criteo._dataset(inputs, args.cache)
    results, id_map = {}, None
    for name in args.techniques:
        baseline_run = args.cache / "model_runs" / f"baseline_seed{args.seeds[0]}"
        if name in NEEDS_BASELINE and "baseline" not in results:
            bench_criteo._fail(f"{name} needs the baseline run first (its learned embeddings)")
        if name in ("hashing_trick", "learned_hash"):
            id_map = id_map or _learned_map(baseline_run, args.cache / "model_runs")
            TECHNIQUES[name] = [*TECHNIQUES[name], f'embedding.id_map="{id_map}"']
        if name == "dmt":
            towers = _proposed_towers(baseline_run, data, args.batch)
            TECHNIQUES[name] = [*TECHNIQUES[name], f"model.towers={json.dumps(towers)}"]
            parameters[name] = _dense_params(TECHNIQUES[name])
        runs = [_train(data, name, TECHNIQUES[name], seed, args, env) for seed in args.seeds]
        mean = {key: sum(run[key] for run in runs) / len(runs) for key in runs[0]}
        results[name] = {**mean, "auc_per_seed": [round(run["auc"], 4) for run in runs]}
        results[name]["dense_step_samples_per_s"] = _dense_step_rate(
            TECHNIQUES[name], args.batch, env
        )
        print(
            f"   dense step alone: {results[name]['dense_step_samples_per_s']:,.0f} samples/s",
            flush=True,
        )

    base = results.get("baseline")
    print(
        f"\n| technique | AUC (mean of {len(args.seeds)}) | AUC per seed | logloss | NE | "
        "NE vs baseline | steady samples/s | vs baseline | dense step alone, samples/s | "
        "dense parameters |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        ne_change = f"{(r['ne'] / base['ne'] - 1) * 100:+.2f}%" if base else "-"
        speed = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
        print(
            f"| {name} | {r['auc']:.4f} | {r['auc_per_seed']} | {r['logloss']:.4f} | "
            f"{r['ne']:.4f} | {ne_change} | {r['samples_per_s']:,.0f} | {speed} | "
            f"{r['dense_step_samples_per_s']:,.0f} | {parameters[name]:,} |"
        )
    summary: dict[str, float | int | None] = {}
    for name in TECHNIQUES:
        r = results.get(name)
        summary[f"{name}_auc"] = round(r["auc"], 4) if r else None
        summary[f"{name}_ne"] = round(r["ne"], 4) if r else None
        summary[f"{name}_logloss"] = round(r["logloss"], 4) if r else None
        summary[f"{name}_samples_per_s"] = round(r["samples_per_s"]) if r else None
        summary[f"{name}_dense_step_samples_per_s"] = (
            round(r["dense_step_samples_per_s"]) if r else None
        )
        summary[f"{name}_dense_params"] = parameters.get(name)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
