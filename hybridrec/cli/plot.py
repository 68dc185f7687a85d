"""`hybridrec plot`: PNG training curves of a run directory."""

from __future__ import annotations

import argparse

from hybridrec.training.plots import plot_run
from hybridrec.training.run_log import run_name


def main(argv: list[str]) -> int:
    """`hybridrec plot`."""
    parser = argparse.ArgumentParser(
        prog="hybridrec plot", description="Write PNG training curves for a run directory."
    )
    parser.add_argument("run_dir", help="run directory written by `hybridrec train`")
    parser.add_argument("--out", help="PNG path (default RUN_DIR/plots/curves.png)")
    args = parser.parse_args(argv)
    written = plot_run(args.run_dir, args.out)
    print(f"{run_name(args.run_dir)}: wrote {' and '.join(map(str, written))}")
    return 0
