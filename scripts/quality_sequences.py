"""Sequential recommendation quality the field's way, with the presets as a user gets them:
SASRec and HSTU on the Amazon Sports / Toys and Yelp histories (one user per line),
leave-one-out, full ranking, test metrics of the checkpoint the run kept as its best on
validation, mean and spread over seeds.

    python scripts/quality_sequences.py --data-dir ../shared/data/sequential_amazon_yelp \
        --datasets toys sports yelp --towers sasrec hstu --seeds 0 1 2

Each dataset goes through the commands a user runs: `hybridrec spec --sample FILE` (its
proposal as it is), `hybridrec preprocess`, then per tower and seed `hybridrec train
--config TOWER --set seed=SEED` (nothing else: the run evaluates its validation split,
keeps its best checkpoint and stops when it no longer improves) and `hybridrec evaluate
--split test` (which reads the best checkpoint). `--set KEY=VALUE` (and `TOWER+KEY=VALUE`,
e.g. `hstu+model.sequence.time_buckets=0`) are for sweeps only: a figure measured with them
is not the presets'.

`--datasets generated` adds the generator's event log (`hybridrec generate --events`, with
times, actions and item features; `--users`).

The last line is one JSON object: `hr10_<dataset>_<tower>`, `ndcg10_<dataset>_<tower>`
(test means, with `_std`), `wall_s_<dataset>_<tower>` (the training command's wall time)
and `best_s_<dataset>_<tower>` (from the run's start to its best checkpoint), means over the
seeds, and `runs` (every run's figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

FILES = {
    "sports": "Sports_and_Outdoors.txt.gz",
    "toys": "Toys_and_Games.txt.gz",
    "yelp": "Yelp.txt.gz",
}
# published full-ranking test HR@10 / NDCG@10 (the data's README)
PUBLISHED = {
    "sports": {
        "SASRec": (0.0350, 0.0192),
        "SASRec+SS": (0.0569, 0.0314),
        "ICSRec": (0.0565, 0.0335),
    },
    "toys": {
        "SASRec": (0.0675, 0.0374),
        "SASRec+SS": (0.0970, 0.0580),
        "ICSRec": (0.1055, 0.0657),
    },
    "yelp": {"SASRec": (0.0274, 0.0136), "ICLRec": (0.0409, 0.0207)},
}


def hybridrec(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "hybridrec", *args], capture_output=True, text=True, check=False
    )
    if result.returncode:
        sys.exit(f"hybridrec {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def preprocess(name: str, source: Path, work: Path) -> Path:
    """The file through `hybridrec spec --sample` (its proposal unchanged) and `preprocess`."""
    out = work / "data" / name
    if (out / "_SUCCESS").exists():
        return out
    spec = work / f"{name}.toml"
    spec.parent.mkdir(parents=True, exist_ok=True)
    hybridrec("spec", "--sample", str(source), "--out", str(spec), "--overwrite")
    hybridrec("preprocess", "-i", str(source), "--spec", str(spec), "-o", str(out))
    return out


def generated(work: Path, users: int) -> Path:
    """The generator's event log at `users` users, preprocessed with its own spec."""
    out = work / "data" / f"generated_{users}"
    if (out / "_SUCCESS").exists():
        return out
    raw = work / f"raw_generated_{users}"
    hybridrec("generate", "--events", "-o", str(raw), "--users", str(users), "--seed", "1")
    hybridrec("preprocess", "-i", str(raw / "events.csv"), "--spec", str(raw / "events.toml"), "-o", str(out))  # fmt: skip
    return out


def train_and_test(data: Path, run: Path, tower: str, seed: int, sweep: list[str]) -> dict:
    """One run of `tower` at `seed` (and the sweep's keys, if any): its test figures at
    the checkpoint it kept, its validation figure there, and its times."""
    name = tower
    tower, *extra = tower.split("+")
    keys = [f"seed={seed}", *sweep, *extra]
    started = time.time()
    hybridrec(
        "train", "--config", tower, "--data", str(data), "--run-dir", str(run), "--overwrite",
        *[item for key in keys for item in ("--set", key)],
    )  # fmt: skip
    seconds = time.time() - started
    summary = json.loads((run / "summary.json").read_text())
    best = summary.get("best") or {}
    test = json.loads(
        hybridrec("evaluate", "--run", str(run), "--split", "test", "--json")
        .strip()
        .splitlines()[-1]
    )
    if best and test["step"] != best["step"]:
        sys.exit(f"{run}: evaluate read step {test['step']}, the run's best is {best['step']}")
    return {
        "tower": name,
        "seed": seed,
        "steps": summary["steps"],
        "best_step": test["step"],
        "valid_hr10": best.get("value"),
        "stopped": summary.get("stopped"),
        "wall_s": round(seconds, 1),
        "best_s": best.get("wall_seconds_to_best"),
        "train_seconds": summary["train_seconds"],
        **{key: test[key] for key in test if key.startswith(("hr@", "ndcg@", "mrr"))},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data-dir", type=Path, default=Path("../shared/data/sequential_amazon_yelp")
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/hybridrec-seq-quality"))
    parser.add_argument("--datasets", nargs="+", default=["toys", "sports", "yelp"], choices=[*sorted(FILES), "generated"])  # fmt: skip
    parser.add_argument("--towers", nargs="+", default=["sasrec", "hstu"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--set", action="append", default=[], help="a sweep's config key, k=v (not the presets')"
    )
    parser.add_argument("--users", type=int, default=20000, help="--datasets generated: users")
    args = parser.parse_args()
    runs, result = [], {}
    for name in args.datasets:
        if name == "generated":
            data = generated(args.work, args.users)
        else:
            source = args.data_dir / FILES[name]
            if not source.exists():
                sys.exit(f"{source}: not found (--data-dir)")
            data = preprocess(name, source, args.work)
        for tower in args.towers:
            figures = []
            for seed in args.seeds:
                run_dir = args.work / "runs" / f"{name}_{tower}_{seed}"
                run = train_and_test(data, run_dir, tower, seed, args.set)
                run["dataset"] = name
                runs.append(run)
                figures.append(run)
                print(
                    f"{name} {tower} seed {seed}: test HR@10 {run['hr@10']:.4f} NDCG@10 "
                    f"{run['ndcg@10']:.4f} (best valid HR@10 {run['valid_hr10'] or 0:.4f} at step "
                    f"{run['best_step']} of {run['steps']}, {run['best_s'] or 0:.0f} s to it, "
                    f"{run['wall_s']:.0f} s in all)",
                    flush=True,
                )
            for key, short in (("hr@10", "hr10"), ("ndcg@10", "ndcg10")):
                values = [run[key] for run in figures]
                result[f"{short}_{name}_{tower}"] = round(statistics.mean(values), 4)
                spread = statistics.stdev(values) if len(values) > 1 else 0.0
                result[f"{short}_{name}_{tower}_std"] = round(spread, 4)
            for key in ("wall_s", "best_s"):
                result[f"{key}_{name}_{tower}"] = round(
                    statistics.mean(run[key] or 0.0 for run in figures), 1
                )
            published = (
                ", ".join(
                    f"{model} {hr:.4f}/{ndcg:.4f}"
                    for model, (hr, ndcg) in PUBLISHED.get(name, {}).items()
                )
                or "none"
            )
            print(
                f"{name} {tower}: test HR@10 {result[f'hr10_{name}_{tower}']:.4f} ± "
                f"{result[f'hr10_{name}_{tower}_std']:.4f}, NDCG@10 "
                f"{result[f'ndcg10_{name}_{tower}']:.4f} over {len(figures)} seeds, "
                f"{result[f'best_s_{name}_{tower}']:.0f} s to the best checkpoint "
                f"(published HR@10/NDCG@10: {published})"
                + (f" [sweep: {' '.join(args.set)}]" if args.set else ""),
                flush=True,
            )
    print(json.dumps({**result, "sweep": args.set, "runs": runs}))


if __name__ == "__main__":
    main()
