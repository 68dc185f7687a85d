"""Quality of the hybrid schedule on real Criteo rows: AUC and logloss for k = 0, 4, 16.

Uses `../shared/data/criteo_kaggle_sample/train.tsv.gz` next to the repository (never
copied into it): first 90% of rows by order for training, last 10% for evaluation,
the Criteo DLRM shape (dim 16, bottom 13-512-256-64-16, top 512-256-1), 1 epoch.
Exits cleanly (status 0, `{"skipped": ...}`) when the sample is absent.

    python scripts/quality_criteo.py [--batch 512] [--seeds 0 1] [--staleness 0 4 16]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLE = REPO_ROOT.parent / "shared" / "data" / "criteo_kaggle_sample" / "train.tsv.gz"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", default=str(SAMPLE), help="Criteo TSV(.gz) file")
    parser.add_argument("--batch", type=int, default=512, help="global batch size")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds per k")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 4, 16], help="k values")
    parser.add_argument("--out", default="runs/quality_criteo", help="work directory")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="extra config overrides"
    )
    args = parser.parse_args(argv)
    if not Path(args.input).exists():
        print(json.dumps({"skipped": f"no Criteo sample at {args.input}"}))
        return 0

    from hybridrec.common import config as config_lib
    from hybridrec.training.config import PRESET_DIR, TrainConfig
    from hybridrec.training.trainer import Trainer

    from hybridrec.cli import run

    out = Path(args.out)
    data = out / "data"
    if not (data / "_SUCCESS").exists():
        code = run(
            "preprocess",
            ["--input", args.input, "--output", str(data), "--eval-fraction", "0.1", "--overwrite"],
        )
        if code:
            return code
    results: dict[int, list[dict]] = {}
    for k in args.staleness:
        for seed in args.seeds:
            run_dir = out / f"k{k}_seed{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)
            config = config_lib.load(
                TrainConfig,
                "criteo_dlrm",
                [
                    f'data.path="{data}"',
                    f"data.batch_size={args.batch}",
                    "data.epochs=1",
                    f"hybrid.staleness={k}",
                    f"seed={seed}",
                    "checkpoint.every_steps=0",
                    "eval.every_steps=0",
                    "log.every_steps=20",
                    *args.overrides,
                ],
                preset_dir=PRESET_DIR,
            )
            summary = Trainer(config, run_dir, quiet=True).fit()
            evaluation = summary["eval"]
            print(
                f"k={k:<3d} seed={seed}: AUC {evaluation['auc']:.4f}  logloss "
                f"{evaluation['logloss']:.4f}  staleness max {summary['staleness_max']}  "
                f"{summary['samples_per_s']:,.0f} samples/s",
                flush=True,
            )
            histogram = summary["staleness_histogram"]
            mean_staleness = sum(i * n for i, n in enumerate(histogram)) / max(sum(histogram), 1)
            results.setdefault(k, []).append(
                {
                    "seed": seed,
                    **evaluation,
                    "samples_per_s": summary["samples_per_s"],
                    "staleness_mean": mean_staleness,
                }
            )

    base = statistics.mean(r["auc"] for r in results[args.staleness[0]])
    first = args.staleness[0]
    print(f"\n| k | staleness used (mean) | AUC | logloss | ΔAUC vs k={first} | samples/s |")
    print("|---|---|---|---|---|---|")
    table = {}
    for k, runs in results.items():
        auc = statistics.mean(r["auc"] for r in runs)
        logloss = statistics.mean(r["logloss"] for r in runs)
        speed = statistics.mean(r["samples_per_s"] for r in runs)
        used = statistics.mean(r["staleness_mean"] for r in runs)
        print(
            f"| {k} | {used:.2f} | {auc:.4f} | {logloss:.4f} | {auc - base:+.4f} | {speed:,.0f} |"
        )
        table[str(k)] = {"auc": auc, "logloss": logloss, "runs": runs}
    print(json.dumps({"batch": args.batch, "seeds": args.seeds, "results": table}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
