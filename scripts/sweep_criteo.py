"""Test AUC of training settings on the Criteo sample, with the PyTorch DLRM reference's split.

The DLRM reference (and TorchRec's DLRM example on Kaggle-format data) cuts the rows, in
file order, into 7 "days" of equal size (the first `rows % 7` one row longer), trains on
the first 6 and tests on the first half of the 7th. On the shared sample that is 117,548
training rows and 9,796 test rows. This script writes those lines into the cache (never
into the repository), preprocesses them once, then trains one epoch per candidate, batch
and seed, each in a fresh `hybridrec train` process, and prints the test AUC per
candidate and batch (mean over seeds) and the steady samples/s.

    python scripts/sweep_criteo.py                              # the built-in candidates
    python scripts/sweep_criteo.py --batches 512 --seeds 0 1 \\
        --candidate "adam-0.01=embedding.optimizer.name=adam,embedding.optimizer.learning_rate=0.01"

A candidate is NAME=SETTING[,SETTING...] of `--set` overrides on the `criteo_dlrm` preset;
NAME starting with "auto" trains without a preset (the "auto" defaults). The last line is
one JSON object: {"auc": {candidate: {batch: mean AUC}}, "steady_samples_per_s": ...,
"best": {batch: candidate}}.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import tempfile
from pathlib import Path

from bench_criteo import REPO, _dataset, _fail, _train, checked_inputs

DAYS = 7  # the DLRM reference's split of the Kaggle rows
REFERENCE_AUC = {128: 0.771, 512: 0.768}  # TorchRec 1.9.2's DLRM example on this split

# name -> overrides of the criteo_dlrm preset ("auto...": no preset); the sweep behind
# the defaults is in docs/training.md ("Accuracy against TorchRec")
CANDIDATES = {
    "preset": [],
    "auto": [],
    "old-preset": [  # before the sweep: Adagrad from optax's 0.1, rate 0.2, dense warmup 100
        "embedding.optimizer.initial_accumulator=0.1",
        "embedding.optimizer.learning_rate=0.2",
        "optimizer.warmup_steps=100",
        "optimizer.decay=constant",
    ],
    "constant-lr": ["optimizer.decay=constant"],  # before the dense rate decayed to the end
    "adagrad-0.03": ["embedding.optimizer.learning_rate=0.03"],
    "adagrad-0.1": ["embedding.optimizer.learning_rate=0.1"],
    "rowwise-0.05": ["embedding.optimizer.name=rowwise_adagrad"],
    "adam-0.01": ["embedding.optimizer.name=adam", "embedding.optimizer.learning_rate=0.01"],
}


def reference_split(source: Path, cache: Path) -> tuple[Path, int, int]:
    """The first 6 days plus the test half of day 7 of `source`, as one TSV in `cache`;
    returns (file, training rows, test rows)."""
    opener = gzip.open if source.suffix == ".gz" else open
    with opener(source, "rb") as handle:
        total = sum(1 for _ in handle)
    per_day, extra = divmod(total, DAYS)
    days = [per_day + (day < extra) for day in range(DAYS)]
    train, test = sum(days[:-1]), (days[-1] + 1) // 2
    target = cache / f"dlrm-split-{source.stem}-{total}.tsv"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkstemp(prefix="partial-", dir=cache)[1])
        with opener(source, "rb") as handle, staging.open("wb") as out:
            for number, line in enumerate(handle):
                if number == train + test:
                    break
                out.write(line)
        staging.rename(target)
    return target, train, test


def _candidate(text: str) -> tuple[str, list[str]]:
    name, _, settings = text.partition("=")
    if not name or not settings:
        raise argparse.ArgumentTypeError(f"--candidate {text!r}: expected NAME=KEY=VALUE[,...]")
    return name, settings.split(",")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", type=Path, help="one Criteo-format file (default: the sample)")
    parser.add_argument("--cache", type=Path, default=REPO / "runs" / "bench_criteo")
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--staleness", type=int, default=4)
    parser.add_argument(
        "--candidate", type=_candidate, action="append", help="NAME=SETTING[,SETTING...]"
    )
    parser.add_argument("--only", nargs="+", help="run these built-in candidates only")
    args = parser.parse_args()
    (source,) = checked_inputs([args.input] if args.input else None)
    candidates = dict(args.candidate) if args.candidate else dict(CANDIDATES)
    if args.only:
        unknown = sorted(set(args.only) - set(CANDIDATES))
        if unknown:
            _fail(f"--only: unknown candidates {unknown}; known: {sorted(CANDIDATES)}")
        candidates = {name: CANDIDATES[name] for name in args.only}
    split, train_rows, test_rows = reference_split(source, args.cache)
    fraction = test_rows / (train_rows + test_rows)
    data = _dataset([split], args.cache, ("--eval-fraction", repr(fraction)))
    print(f"split: {train_rows:,} training rows, {test_rows:,} test rows ({data})", flush=True)
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["HYBRIDREC_COMPILATION_CACHE"] = str(args.cache / "jax-cache")
    work = args.cache / "sweep"
    auc: dict[str, dict[int, float]] = {}
    speed: dict[str, dict[int, float]] = {}
    for name, settings in candidates.items():
        preset = None if name.startswith("auto") else "criteo_dlrm"
        for batch in args.batches:
            runs = [
                _train(
                    data,
                    batch,
                    args.staleness,
                    work,
                    env,
                    settings,
                    seed,
                    tag=f"_{name}",
                    preset=preset,
                )
                for seed in args.seeds
            ]
            auc.setdefault(name, {})[batch] = round(statistics.mean(r["auc"] for r in runs), 4)
            speed.setdefault(name, {})[batch] = round(
                statistics.mean(r["steady_samples_per_s"] for r in runs)
            )
            per_seed = [round(r["auc"], 4) for r in runs]
            print(f"-> {name} batch {batch}: AUC {auc[name][batch]} {per_seed}", flush=True)
    print(
        "\n| candidate | " + " | ".join(f"AUC b{b} | samples/s b{b}" for b in args.batches) + " |"
    )
    print("|---|" + "---|---|" * len(args.batches))
    for name in candidates:
        cells = [f"{auc[name][b]:.4f} | {speed[name][b]:,}" for b in args.batches]
        print(f"| {name} | " + " | ".join(cells) + " |")
    best = {b: max(candidates, key=lambda name: auc[name][b]) for b in args.batches}
    for batch, name in best.items():
        reference = REFERENCE_AUC.get(batch)
        against = f" (TorchRec's DLRM example: {reference})" if reference else ""
        print(f"batch {batch}: best {name}, AUC {auc[name][batch]:.4f}{against}")
    print(json.dumps({"auc": auc, "steady_samples_per_s": speed, "best": best}))


if __name__ == "__main__":
    main()
