"""Model techniques against their baselines on Criteo data: DHEN, DMT towers, Shampoo.

Preprocesses the input once (the cache of scripts/bench_criteo.py), then trains the
`criteo_dlrm` preset once per technique and seed, each in a fresh `hybridrec train`
process, with the same split, batch, epochs and embedding settings; only the tower or
the dense optimizer changes:

    baseline   DLRM (the preset), Adam
    dcnv2      DCN-V2, three rank-64 cross layers and a 512-256 deep MLP, Adam
    dhen       DHEN, two layers of dot + cross + attention + MLP modules, Adam
    shampoo    DLRM with blocked Shampoo grafted onto Adam (block 128, roots every 10 steps)
    dmt        DLRM over four DMT towers of the 26 features, each compressing to 2 vectors

Training is synchronous (`hybrid.staleness = 0`) so that the runs differ only by the
technique, not by the timing of the asynchronous embedding updates. Per run: eval AUC,
logloss and normalized entropy (on the held-out split), steady samples/s (after the first
20 steps) and the dense parameter count; per technique the mean over seeds.

    python scripts/bench_models.py                         # the shared Criteo sample
    python scripts/bench_models.py --input day_0.gz --seeds 0 1 2

The last line is one JSON object: `<technique>_auc`, `<technique>_ne`, `<technique>_logloss`,
`<technique>_samples_per_s`, `<technique>_dense_params` for baseline, dcnv2, dhen, shampoo,
dmt and learned_hash (null: learned hash functions are not built).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import bench_criteo  # the preprocessing cache and child-process runner shared with it

REPO = Path(__file__).resolve().parent.parent
STEADY_AFTER = 20  # steps excluded from the steady rate (compilation, warm-up)
# Four towers of the 26 Criteo features (C1..C26 in the dataset's order), each compressed
# to two 16-dim vectors before the global DLRM interaction; see docs/models.md.
DMT_TOWERS = "[[0,1,2,3,4,5,6],[7,8,9,10,11,12,13],[14,15,16,17,18,19],[20,21,22,23,24,25]]"
TECHNIQUES = {
    "baseline": [],
    "dcnv2": ["model.tower=dcnv2", "model.dcnv2.low_rank=64"],
    "dhen": ["model.tower=dhen"],
    "shampoo": ["optimizer.name=shampoo"],
    "dmt": [f"model.towers={DMT_TOWERS}", "model.tower_outputs=2"],
}
NOT_BUILT = ["learned_hash"]


def _dense_params(settings: list[str]) -> int:
    """Parameters of the dense tower these overrides give (13 dense, 26 x dim embeddings)."""
    import jax
    from flax import nnx

    from common import config as config_lib
    from model import build_tower
    from training.config import PRESET_DIR, TrainConfig

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
    args = parser.parse_args()
    inputs = args.input or [bench_criteo.SAMPLE]
    if not args.input and not bench_criteo.SAMPLE.exists():
        bench_criteo._fail(f"{bench_criteo.SAMPLE} is absent: pass --input FILE...")
    for path in inputs:
        bench_criteo._check_criteo(path)
    parameters = {name: _dense_params(TECHNIQUES[name]) for name in args.techniques}
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the trainer's own device layout
    data = bench_criteo._dataset(inputs, args.cache)
    results = {}
    for name in args.techniques:
        runs = [_train(data, name, TECHNIQUES[name], seed, args, env) for seed in args.seeds]
        mean = {key: sum(run[key] for run in runs) / len(runs) for key in runs[0]}
        results[name] = {**mean, "auc_per_seed": [round(run["auc"], 4) for run in runs]}

    base = results.get("baseline")
    print(
        f"\n| technique | AUC (mean of {len(args.seeds)}) | AUC per seed | logloss | NE | "
        "NE vs baseline | steady samples/s | vs baseline | dense parameters |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        ne_change = f"{(r['ne'] / base['ne'] - 1) * 100:+.2f}%" if base else "-"
        speed = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
        print(
            f"| {name} | {r['auc']:.4f} | {r['auc_per_seed']} | {r['logloss']:.4f} | "
            f"{r['ne']:.4f} | {ne_change} | {r['samples_per_s']:,.0f} | {speed} | "
            f"{parameters[name]:,} |"
        )
    summary: dict[str, float | int | None] = {}
    for name in [*TECHNIQUES, *NOT_BUILT]:
        r = results.get(name)
        summary[f"{name}_auc"] = round(r["auc"], 4) if r else None
        summary[f"{name}_ne"] = round(r["ne"], 4) if r else None
        summary[f"{name}_logloss"] = round(r["logloss"], 4) if r else None
        summary[f"{name}_samples_per_s"] = round(r["samples_per_s"]) if r else None
        summary[f"{name}_dense_params"] = parameters.get(name)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
