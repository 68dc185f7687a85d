"""`hybridrec evaluate`: a run's checkpoint on a split: AUC, logloss, NE and calibration
(click logs), or HR@K, NDCG@K and MRR by full ranking (user histories)."""

from __future__ import annotations

import argparse
import json

import jax

from hybridrec.cli import _flags
from hybridrec.cli._compilation_cache import use_compilation_cache
from hybridrec.training.evaluate import describe, evaluate_checkpoint
from hybridrec.training.run_log import run_name


def main(argv: list[str]) -> int:
    """`hybridrec evaluate`."""
    parser = argparse.ArgumentParser(
        prog="hybridrec evaluate", description="Evaluate a run's checkpoint on a data split."
    )
    parser.add_argument("--run", required=True, help="run directory written by `hybridrec train`")
    parser.add_argument(
        "--step",
        type=_flags.checkpoint_step,
        help="checkpoint step, best (checkpoint.keep_best) or latest; default: the best when "
        "the run kept one, else the newest complete",
    )
    parser.add_argument("--split", help="data split (default: the run's eval split)")
    parser.add_argument(
        "--data",
        help="evaluate on another preprocessed directory with the run's features (the "
        "result goes to its own file, named after it)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    _flags.add_distributed_flags(parser)
    args = parser.parse_args(argv)
    use_compilation_cache()
    results = evaluate_checkpoint(
        args.run,
        step=args.step,
        split=args.split,
        data=args.data,
        distributed=_flags.distributed_options(args),
        quiet=args.json,
    )
    if jax.process_index() == 0:
        if args.json:
            print(json.dumps(results))
        else:
            on = results["split"] + (f" of {args.data}" if args.data else "")
            print(
                f"{run_name(args.run)} step {results['step']} ({results['step_reason']}) on "
                f"{on}: {describe(results)}\nwritten to {results['output']}"
            )
    return 0
