"""`hybridrec generate`: synthetic click logs in the raw Criteo TSV layout (pipeline.generate)."""

from __future__ import annotations

import argparse

from hybridrec.pipeline import generate


def main(argv: list[str]) -> int:
    """`hybridrec generate`."""
    parser = argparse.ArgumentParser(
        prog="hybridrec generate",
        description="Write synthetic click logs in the raw Criteo TSV layout.",
    )
    parser.add_argument("--output", "-o", required=True, help="output file (.gz: gzip)")
    parser.add_argument("--rows", type=int, default=100_000, help="number of rows")
    parser.add_argument("--seed", type=int, default=0, help="random seed (same seed, same file)")
    parser.add_argument("--gzip", action="store_true", help="gzip even without a .gz suffix")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: cores)")
    parser.add_argument(
        "--cardinality-scale",
        type=float,
        default=1.0,
        help="multiplies the long-tail features' cardinalities (100k values and more); "
        "10 gives ~10M distinct ids over them in 10M rows",
    )
    args = parser.parse_args(argv)
    summary = generate(
        args.output,
        args.rows,
        seed=args.seed,
        compress=args.gzip or None,
        workers=args.workers,
        cardinality_scale=args.cardinality_scale,
    )
    rate = summary["rows"] / max(summary["seconds"], 1e-9)
    clicks = summary["clicks"] / max(summary["rows"], 1)
    print(
        f"wrote {summary['rows']:,} rows ({clicks:.1%} clicks, {summary['bytes'] / 1e6:.1f} MB) "
        f"to {summary['path']} in {summary['seconds']:.1f}s ({rate:,.0f} rows/s)"
    )
    return 0
