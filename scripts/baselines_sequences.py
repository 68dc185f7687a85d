"""Popularity and item-to-item co-occurrence on an event dataset's leave-one-out test split
(full ranking, HR@K / NDCG@K / MRR, the history excluded and not), and for a generated log
what a model that knew how it was made would reach (`oracle_hit_rate`).

    python scripts/baselines_sequences.py --data DATA_DIR
    python scripts/baselines_sequences.py --generate --users 20000 --items 5000   # a generated log

The last line is one JSON object: per baseline and history convention its metrics
(`popularity_hr@10`, `cooccurrence_ndcg@10_excluded`, ...), and `oracle_hr@10` for a
generated log.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from hybridrec.pipeline.events.synthetic_events import EventLogConfig, oracle_hit_rate
from hybridrec.training.sequences.baselines import evaluate_baselines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="a preprocessed event dataset")
    parser.add_argument("--generate", action="store_true", help="generate and preprocess one")
    parser.add_argument("--users", type=int, default=20_000)
    parser.add_argument("--items", type=int, default=5_000)
    parser.add_argument("--mean-events", type=float, default=50.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    summary: dict = {}
    with tempfile.TemporaryDirectory() as work:
        data = args.data
        if args.generate:
            raw, data = Path(work) / "raw", Path(work) / "data"
            command = [sys.executable, "-m", "hybridrec", "generate", "--events", "-o", str(raw)]
            command += ["--users", str(args.users), "--items", str(args.items)]
            command += ["--mean-events", str(args.mean_events), "--seed", str(args.seed)]
            subprocess.run(command, check=True)
            command = [sys.executable, "-m", "hybridrec", "preprocess", "--quiet"]
            command += ["-i", str(raw / "events.csv"), "--spec", str(raw / "events.toml")]
            subprocess.run([*command, "-o", str(data)], check=True)
            config = EventLogConfig(
                users=args.users, items=args.items, mean_events=args.mean_events, seed=args.seed
            )
            summary["oracle_hr@10"] = round(oracle_hit_rate(config), 4)
        elif data is None:
            parser.error("give --data DATA_DIR or --generate")
        for excluded in (False, True):
            result = evaluate_baselines(data, exclude_history=excluded)
            suffix = "_excluded" if excluded else ""
            for name in ("popularity", "cooccurrence"):
                for metric, value in result[name].items():
                    summary[f"{name}_{metric}{suffix}"] = round(value, 4)
            summary["users"] = result["users"]
    for name in ("popularity", "cooccurrence"):
        print(
            f"{name:13s} HR@10 {summary[f'{name}_hr@10']:.4f}  NDCG@10 "
            f"{summary[f'{name}_ndcg@10']:.4f}  (history excluded: HR@10 "
            f"{summary[f'{name}_hr@10_excluded']:.4f})"
        )
    if "oracle_hr@10" in summary:
        print(f"oracle        HR@10 {summary['oracle_hr@10']:.4f} (how the log was made, known)")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
