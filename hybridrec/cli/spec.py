"""`hybridrec spec --sample FILE`: a feature spec proposed from the first rows of a log."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridrec.common.errors import UserError
from hybridrec.pipeline.infer_spec import SAMPLE_ROWS, propose_spec

SHOWN_LINES = 5  # line numbers listed of the sample lines left out


def main(argv: list[str]) -> int:
    """`hybridrec spec`."""
    parser = argparse.ArgumentParser(
        prog="hybridrec spec",
        description="Propose a feature spec (TOML) from a sample of a CSV/TSV log, plain or "
        ".gz: separator, header and each column's kind, with the reasons.",
    )
    parser.add_argument("--sample", required=True, help="raw log file to read the first rows of")
    parser.add_argument("--out", help="write the spec here (default: print it)")
    parser.add_argument(
        "--rows", type=int, default=SAMPLE_ROWS, help=f"rows to read (default {SAMPLE_ROWS})"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)
    if args.rows < 2:
        raise UserError(f"--rows {args.rows}: need at least 2 rows to tell column kinds apart")
    out = Path(args.out) if args.out else None
    if out and out.exists() and not args.overwrite:
        raise UserError(f"{out} already exists; pass --overwrite to replace it")
    proposed = propose_spec(args.sample, max_rows=args.rows)
    skipped = proposed.skipped_lines
    if skipped:
        shown = ", ".join(str(number) for number in skipped[:SHOWN_LINES])
        more = f" and {len(skipped) - SHOWN_LINES} more" if len(skipped) > SHOWN_LINES else ""
        print(
            f"hybridrec spec: note: {args.sample}: left out {len(skipped)} line(s) without the "
            f"{len(proposed.spec.columns)} fields of the others: line {shown}{more} "
            "(preprocess rejects such lines as wrong_field_count)",
            file=sys.stderr,
        )
    if out is None:
        sys.stdout.write(proposed.toml)
        return 0
    temporary = out.with_name(out.name + ".partial")
    temporary.write_text(proposed.toml)
    temporary.replace(out)
    width = max(len(column.name) for column in proposed.columns)
    kinds = max(len(column.kind) for column in proposed.columns)
    for column in proposed.columns:
        print(f"  {column.name:<{width}}  {column.kind:<{kinds}}  {column.reason}")
    print(
        f"wrote {out} (from {proposed.rows} rows of {args.sample}); check it, then:\n"
        f"  hybridrec preprocess --input {args.sample} --spec {out} --output DATA_DIR"
    )
    return 0
