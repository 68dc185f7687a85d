"""Command lines of `hybridrec train` and `hybridrec evaluate` (the work is in model.trainer)."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import jax

from hybridrec import config as config_lib
from hybridrec.errors import UserError
from model.trainer import HybridTrainer, evaluate_checkpoint, load_config


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="preset name (hybridrec/configs) or TOML file")
    config_lib.add_override_flag(
        parser, "override a config key, e.g. --set hybrid.staleness=0 (repeatable)"
    )
    parser.add_argument(
        "positional_overrides", nargs="*", metavar="KEY=VALUE", help="more overrides"
    )


def _distributed_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--coordinator", help="host:port of process 0 (multi-process jobs)")
    parser.add_argument("--num-processes", type=int, help="processes in the job")
    parser.add_argument("--process-id", type=int, help="this process's index")


def _distributed(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "coordinator": args.coordinator,
        "num_processes": args.num_processes,
        "process_id": args.process_id,
    }


def _print_summary(summary: dict[str, Any]) -> None:
    evaluation = summary.get("eval") or {}
    lines = [
        "",
        "training finished",
        f"  steps           {summary['steps']}  ({summary['samples']:,} samples, "
        f"{summary['processes']} process(es), {summary['devices']} devices)",
        f"  throughput      {summary['samples_per_s'] or 0:,.0f} samples/s",
        f"  staleness       max {summary['staleness_max']} (bound {summary['staleness_bound']})",
    ]
    store = summary.get("embedding_store") or {}
    if store:
        lines.append(
            f"  embeddings      {store.get('rows', 0):,} rows in {store.get('num_shards', 0)} shards, "
            f"{store.get('evicted_lru', 0) + store.get('evicted_ttl', 0):,} evicted, "
            f"{store.get('nonfinite_skipped', 0):,} non-finite updates skipped"
        )
    if evaluation:
        lines.append(
            f"  eval            AUC {evaluation.get('auc', math.nan):.4f}  logloss "
            f"{evaluation.get('logloss', math.nan):.4f}  NE {evaluation.get('ne', math.nan):.4f}  "
            f"calibration {evaluation.get('calibration', math.nan):.3f}  "
            f"({int(evaluation.get('count', 0)):,} rows)"
        )
    lines += [
        f"  run directory   {summary['run_dir']}",
        f"  metrics         {summary['metrics_file']}",
        f"  tensorboard     {summary['tensorboard_dir']}",
        f"  checkpoint      step {summary['checkpoint_step']} in {summary['run_dir']}/checkpoints",
    ]
    print("\n".join(lines), flush=True)


def main(argv: list[str]) -> int:
    """`hybridrec train`."""
    parser = argparse.ArgumentParser(
        prog="hybridrec train",
        description="Train with the hybrid loop: async embedding store, synchronous dense step.",
    )
    parser.add_argument("--data", help="preprocessed data directory (sets data.path)")
    parser.add_argument("--run-dir", required=True, help="output directory of this run")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument(
        "--overwrite", action="store_true", help="delete run-dir's old contents first"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    _config_arguments(parser)
    _distributed_arguments(parser)
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    overrides = [*args.overrides, *args.positional_overrides]
    if args.data:
        overrides.append(f"data.path={json.dumps(str(args.data))}")
    if args.overwrite and args.resume:
        raise UserError("--overwrite and --resume contradict each other")
    if args.overwrite and run_dir.exists() and (args.process_id or 0) == 0:
        shutil.rmtree(run_dir)
    config = load_config(args.config, overrides, run_dir if args.resume else None)
    trainer = HybridTrainer(
        config, run_dir, resume=args.resume, distributed=_distributed(args), quiet=args.quiet
    )
    summary = trainer.fit()
    if trainer.is_chief:
        _print_summary(summary)
    return 0


def evaluate_main(argv: list[str]) -> int:
    """`hybridrec evaluate`."""
    parser = argparse.ArgumentParser(
        prog="hybridrec evaluate", description="Evaluate a run's checkpoint on a data split."
    )
    parser.add_argument("--run", required=True, help="run directory written by `hybridrec train`")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest complete)")
    parser.add_argument("--split", help="data split (default: the run's eval split)")
    parser.add_argument("--data", help="evaluate on another preprocessed directory")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    _distributed_arguments(parser)
    args = parser.parse_args(argv)
    overrides = [f"data.path={json.dumps(str(args.data))}"] if args.data else []
    results = evaluate_checkpoint(
        args.run,
        step=args.step,
        split=args.split,
        overrides=overrides,
        distributed=_distributed(args),
        quiet=args.json,
    )
    if jax.process_index() == 0:
        if args.json:
            print(json.dumps(results))
        else:
            print(
                f"step {results['step']} on {results['split']}: AUC {results['auc']:.4f}  "
                f"logloss {results['logloss']:.4f}  NE {results['ne']:.4f}  "
                f"calibration {results['calibration']:.3f}  ({int(results['count']):,} rows)\n"
                f"written to {results['output']}"
            )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
