"""Learned id -> bucket mappings against the hashing trick and against no collisions.

On the shared Criteo sample (preprocessed once, cached like scripts/bench_criteo.py):
  1. train the `criteo_dlrm` preset one epoch with every id its own row (the source run,
     and the no-collision reference);
  2. `hybridrec learn-hash` from it with a row budget of `--fraction` of each feature's
     distinct training ids;
  3. train the same preset at that budget with the learned mapping and with the hashing
     trick (`embedding.id_map_kind`), for every `--seeds` seed.
Every run is synchronous (hybrid.staleness = 0) so that seeds, not update timing, make
the differences; eval AUC on the held-out split.

    python scripts/bench_learned_hash.py [--fraction 0.2] [--seeds 0 1]

The map is learned from a run on the same training split (the "previous run" of the
method); in production it would come from earlier data.

Last line: one JSON object with no_collision_auc, hashing_trick_auc, learned_hash_auc,
their logloss and NE, the fraction and the rows held.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_criteo import REPO, _dataset, _fail, checked_inputs  # noqa: E402


def _train(data: Path, run_dir: Path, batch: int, seed: int, extra: list[str]) -> dict:
    command = [sys.executable, "-m", "hybridrec", "train", "--config", "criteo_dlrm", "--quiet"]
    command += ["--data", str(data), "--run-dir", str(run_dir), "--overwrite"]
    for setting in (f"data.batch_size={batch}", "hybrid.staleness=0", f"seed={seed}", *extra):
        command += ["--set", setting]
    print(f"== {run_dir.name}: {' '.join(extra) or 'every id its own row'}", flush=True)
    if subprocess.run(command, cwd=REPO).returncode:
        _fail(f"training {run_dir.name} failed; see the output above")
    summary = json.loads((run_dir / "summary.json").read_text())
    result = {key: summary["eval"][key] for key in ("auc", "logloss", "ne")}
    result["rows"] = summary["embedding_store"]["rows"]
    print(f"   AUC {result['auc']:.4f}  logloss {result['logloss']:.4f}  rows {result['rows']:,}")
    return result


def _mean(runs: list[dict]) -> dict:
    return {key: sum(run[key] for run in runs) / len(runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", type=Path, help="Criteo-format files")
    parser.add_argument("--cache", type=Path, default=REPO / "runs" / "bench_criteo")
    parser.add_argument("--fraction", type=float, default=0.2, help="rows per feature / its ids")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args()
    inputs = checked_inputs(args.input)
    data = _dataset(inputs, args.cache)
    work = args.cache / "learned_hash"
    results: dict[str, list[dict]] = {"no_collision": [], "hashing_trick": [], "learned_hash": []}
    source = work / "source_seed0"
    for seed in args.seeds:
        run_dir = source if seed == args.seeds[0] else work / f"source_seed{seed}"
        results["no_collision"].append(_train(data, run_dir, args.batch, seed, []))
    id_map = work / f"map_{args.fraction:g}"
    command = [sys.executable, "-m", "hybridrec", "learn-hash", "--run", str(source)]
    command += ["--out", str(id_map), "--fraction", str(args.fraction)]
    if subprocess.run(command, cwd=REPO).returncode:
        _fail("learn-hash failed; see the output above")
    for seed in args.seeds:
        for kind, name in (("hashing_trick", "hashing_trick"), ("learned", "learned_hash")):
            extra = [f'embedding.id_map="{id_map}"', f'embedding.id_map_kind="{kind}"']
            results[name].append(_train(data, work / f"{name}_seed{seed}", args.batch, seed, extra))
    means = {name: _mean(runs) for name, runs in results.items()}
    print(f"\n| ids -> rows (fraction {args.fraction:g}) | eval AUC | logloss | NE | rows held |")
    print("|---|---|---|---|---|")
    for name, mean in means.items():
        per_seed = ", ".join(f"{run['auc']:.4f}" for run in results[name])
        print(
            f"| {name} | {mean['auc']:.4f} ({per_seed}) | {mean['logloss']:.4f} | "
            f"{mean['ne']:.4f} | {mean['rows']:,.0f} |"
        )
    summary = {"fraction": args.fraction, "seeds": args.seeds}
    for name, mean in means.items():
        summary.update({f"{name}_auc": round(mean["auc"], 4), f"{name}_ne": round(mean["ne"], 4)})
        summary.update({f"{name}_logloss": round(mean["logloss"], 4)})
        summary[f"{name}_rows"] = round(mean["rows"])
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
