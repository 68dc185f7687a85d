"""`hybridrec export`: a run's checkpoint -> a self-contained, versioned serving directory."""

from __future__ import annotations

import argparse

from hybridrec.serving.export import export_run


def main(argv: list[str]) -> int:
    """`hybridrec export`."""
    parser = argparse.ArgumentParser(
        prog="hybridrec export",
        description="Export a run's checkpoint (StableHLO tower, embedding rows, feature "
        "spec) as the next version of an export directory, for `hybridrec serve`.",
    )
    parser.add_argument("--run", required=True, help="run directory written by `hybridrec train`")
    parser.add_argument("--out", required=True, help="export directory (versions go in OUT/<n>)")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest complete)")
    parser.add_argument(
        "--precision",
        choices=("fp32", "fp16", "int8"),
        default="fp32",
        help="embedding rows: fp32, fp16, or int8 row-wise with fp16 scale and bias",
    )
    parser.add_argument("--name", help="model name in the serving URLs (default: OUT's name)")
    args = parser.parse_args(argv)
    summary = export_run(
        args.run, args.out, step=args.step, precision=args.precision, name=args.name
    )
    megabytes = 1 << 20
    print(
        f"exported step {summary['step']} of {args.run} as {summary['name']!r} version "
        f"{summary['version']} ({summary['precision']}) in {summary['seconds']:.1f} s\n"
        f"  {summary['path']}: {summary['total_bytes'] / megabytes:.1f} MiB "
        f"(embeddings {summary['embedding_bytes'] / megabytes:.1f} MiB, id index "
        f"{summary['index_bytes'] / megabytes:.1f} MiB, tower {summary['tower_bytes'] / megabytes:.2f} MiB)\n"
        f"  next: hybridrec serve {args.out}"
    )
    return 0
