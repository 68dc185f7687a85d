"""Sequential recommendation quality the field's way: SASRec and HSTU on the Amazon Sports /
Toys and Yelp histories (one user per line), leave-one-out, full ranking, the checkpoint
chosen on validation HR@10, its test metrics, mean and spread over seeds.

    python scripts/quality_sequences.py --data-dir ../shared/data/sequential_amazon_yelp \
        --datasets toys sports --towers sasrec hstu --seeds 0 1 2

`--datasets generated` adds the generator's event log (`hybridrec generate --events`, with
times, actions and item features; `--users`). A tower may carry config keys after `+`:
`--towers hstu hstu+model.sequence.time_buckets=0` compares HSTU with and without its
time-gap bias.

Each run is `hybridrec train --config TOWER` with an evaluation of the validation split and
a checkpoint every `--eval-every` steps (all kept), then `hybridrec evaluate --split test
--step BEST`. The last line is one JSON object: `hr10_<dataset>_<tower>`,
`ndcg10_<dataset>_<tower>` (test means) and `runs` (every run's figures).
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
    "sports": {"SASRec": (0.0350, 0.0192), "ICLRec": (0.0437, 0.0238), "ICSRec": (0.0565, 0.0335)},
    "toys": {"SASRec": (0.0675, 0.0374), "ICLRec": (0.0834, 0.0480), "ICSRec": (0.1055, 0.0657)},
    "yelp": {"SASRec": (0.0274, 0.0136), "ICLRec": (0.0409, 0.0207)},
}
SPEC = """kind = "events"
name = "{name}"
format = "user_per_line"
delimiter = "whitespace"
header = false
max_length = {max_length}
min_events = 3
drop_duplicates = false

[split]
kind = "leave_one_out"
"""


def hybridrec(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "hybridrec", *args], capture_output=True, text=True, check=False
    )
    if result.returncode:
        sys.exit(f"hybridrec {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def preprocess(name: str, source: Path, work: Path, max_length: int) -> Path:
    out = work / "data" / name
    if (out / "_SUCCESS").exists():
        return out
    spec = work / f"{name}.toml"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(SPEC.format(name=name, max_length=max_length))
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


def train_and_test(data: Path, run: Path, tower: str, seed: int, args) -> dict:
    name = tower
    tower, *extra = tower.split("+")
    keys = [
        f"seed={seed}",
        f"data.epochs={args.epochs}",
        f"data.token_budget={args.token_budget}",
        f"model.sequence.max_length={args.max_length}",
        f"eval.every_steps={args.eval_every}",
        f"checkpoint.every_steps={args.eval_every}",
        "checkpoint.keep=1000",
        "log.every_steps=200",
        *args.set,
        *extra,
    ]
    started = time.time()
    hybridrec(
        "train", "--config", tower, "--data", str(data), "--run-dir", str(run), "--overwrite",
        *[item for key in keys for item in ("--set", key)],
    )  # fmt: skip
    seconds = time.time() - started
    evals = [
        json.loads(line)
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if '"kind": "eval"' in line
    ]
    best = max(evals, key=lambda record: (record["hr@10"], -record["step"]))
    test = json.loads(
        hybridrec(
            "evaluate", "--run", str(run), "--split", "test", "--step", str(best["step"]), "--json"
        )
        .strip()
        .splitlines()[-1]
    )
    return {
        "tower": name,
        "seed": seed,
        "best_step": best["step"],
        "valid_hr10": best["hr@10"],
        "train_seconds": round(seconds, 1),
        **{key: test[key] for key in test if key.startswith(("hr@", "ndcg@", "mrr"))},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data-dir", type=Path, default=Path("../shared/data/sequential_amazon_yelp")
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/hybridrec-seq-quality"))
    parser.add_argument("--datasets", nargs="+", default=["toys", "sports"], choices=[*sorted(FILES), "generated"])  # fmt: skip
    parser.add_argument("--towers", nargs="+", default=["sasrec", "hstu"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--max-length", type=int, default=50)
    parser.add_argument("--token-budget", type=int, default=2000)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--set", action="append", default=[], help="more config keys, k=v")
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
            data = preprocess(name, source, args.work, args.max_length)
        for tower in args.towers:
            figures = []
            for seed in args.seeds:
                run = train_and_test(
                    data, args.work / "runs" / f"{name}_{tower}_{seed}", tower, seed, args
                )
                run["dataset"] = name
                runs.append(run)
                figures.append(run)
                print(
                    f"{name} {tower} seed {seed}: test HR@10 {run['hr@10']:.4f} NDCG@10 "
                    f"{run['ndcg@10']:.4f} (best valid HR@10 {run['valid_hr10']:.4f} at step "
                    f"{run['best_step']}, {run['train_seconds']:.0f}s)",
                    flush=True,
                )
            for key, short in (("hr@10", "hr10"), ("ndcg@10", "ndcg10")):
                values = [run[key] for run in figures]
                result[f"{short}_{name}_{tower}"] = round(statistics.mean(values), 4)
                spread = statistics.stdev(values) if len(values) > 1 else 0.0
                result[f"{short}_{name}_{tower}_std"] = round(spread, 4)
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
                f"{result[f'ndcg10_{name}_{tower}']:.4f} over {len(figures)} seeds "
                f"(published HR@10/NDCG@10: {published})",
                flush=True,
            )
    print(json.dumps({**result, "runs": runs}))


if __name__ == "__main__":
    main()
