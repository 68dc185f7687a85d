"""`hybridrec learn-hash`: a learned id -> bucket mapping from a trained run (training.learned_hash)."""

from __future__ import annotations

import argparse
import logging
import time

from hybridrec.training.learned.hash_map import learn_id_map


def main(argv: list[str]) -> int:
    """`hybridrec learn-hash`."""
    parser = argparse.ArgumentParser(
        prog="hybridrec learn-hash",
        description="Learn, per feature, which ids share an embedding row when a table holds "
        "only a fraction of the ids: frequent ids alone, the tail grouped by the run's "
        "embeddings. Train with it: --set embedding.id_map='\"OUT\"'.",
    )
    parser.add_argument(
        "--run", required=True, help="a trained run directory (its newest checkpoint)"
    )
    parser.add_argument("--out", required=True, help="directory to write the mapping to")
    parser.add_argument(
        "--fraction", type=float, default=0.25, help="rows per feature as a fraction of its ids"
    )
    parser.add_argument(
        "--exclusive-share",
        type=float,
        default=0.5,
        help="share of a feature's rows that hold one frequent id each",
    )
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest complete)")
    args = parser.parse_args(argv)
    logging.getLogger().setLevel(logging.ERROR)  # Beam's import-time warnings stay out
    started = time.perf_counter()
    print(f"[learn-hash] counting ids of {args.run}'s training split (Beam) ...", flush=True)
    summary = learn_id_map(
        args.run,
        args.out,
        fraction=args.fraction,
        exclusive_share=args.exclusive_share,
        step=args.step,
    )
    print(
        f"wrote {summary['out']}: {summary['ids']:,} ids of {summary['features']} features -> "
        f"{summary['buckets']:,} rows ({summary['buckets'] / max(summary['ids'], 1):.0%}), from "
        f"step {summary['step']}, in {time.perf_counter() - started:.1f}s\n"
        f"  train with it: hybridrec train ... --set embedding.id_map='\"{summary['out']}\"' "
        f"(or --set embedding.id_map_kind='\"hashing_trick\"' for the same budget, hashed)"
    )
    return 0
