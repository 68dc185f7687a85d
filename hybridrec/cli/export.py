"""`hybridrec export`: a run's checkpoint -> a self-contained, versioned serving directory."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hybridrec.cli import _flags
from hybridrec.common.errors import UserError
from hybridrec.pipeline.metadata import METADATA_FILE, SUCCESS_FILE
from hybridrec.serving import MANIFEST_FILE
from hybridrec.serving.export import export_run
from hybridrec.training.run_dir import RUN_MARKERS
from hybridrec.training.run_log import run_name


def main(argv: list[str]) -> int:
    """`hybridrec export`."""
    parser = argparse.ArgumentParser(
        prog="hybridrec export",
        description="Export a run's checkpoint (StableHLO tower, embedding rows, feature "
        "spec) as the next version of an export directory, for `hybridrec serve`.",
    )
    parser.add_argument("--run", required=True, help="run directory written by `hybridrec train`")
    parser.add_argument(
        "--out",
        required=True,
        help="export directory of its own, e.g. exports/RUN_NAME (versions go in OUT/<n>)",
    )
    parser.add_argument(
        "--step",
        type=_flags.checkpoint_step,
        help="checkpoint step, best (checkpoint.keep_best) or latest; default: the best when "
        "the run kept one, else the newest complete",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "fp16", "int8"),
        default="fp32",
        help="embedding rows: fp32, fp16, or int8 row-wise with fp16 scale and bias",
    )
    parser.add_argument("--name", help="model name in the serving URLs (default: OUT's name)")
    args = parser.parse_args(argv)
    check_out(Path(args.out), args.run)
    summary = export_run(
        args.run, args.out, step=args.step, precision=args.precision, name=args.name
    )
    megabytes = 1 << 20
    print(
        f"exported step {summary['step']} ({summary['step_reason']}) of {args.run} as "
        f"{summary['name']!r} version "
        f"{summary['version']} ({summary['precision']}) in {summary['seconds']:.1f} s\n"
        f"  {summary['path']}: {summary['total_bytes'] / megabytes:.1f} MiB "
        f"(embeddings {summary['embedding_bytes'] / megabytes:.1f} MiB, id index "
        f"{summary['index_bytes'] / megabytes:.1f} MiB, tower {summary['tower_bytes'] / megabytes:.2f} MiB)\n"
        f"  next: hybridrec serve {args.out}"
    )
    return 0


def not_an_export(path: Path) -> tuple[str, str] | None:
    """("run" | "dataset", its description) if `path` is a directory of that kind, else None."""
    for kind, markers in (
        ("run", RUN_MARKERS),
        ("dataset", (METADATA_FILE, SUCCESS_FILE)),
    ):
        if found := [name for name in markers if (path / name).exists()]:
            return kind, f"a {kind} directory (it holds {', '.join(found)})"
    return None


def check_out(out: Path, run_dir: str) -> None:
    """A one-line UserError unless `out` can take export versions: a directory of its own
    (new, or an export's base directory) under a writable directory."""
    instead = f"pass a directory of its own, e.g. --out exports/{run_name(run_dir)}"
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; {instead}")
    if other := not_an_export(out):
        raise UserError(
            f"--out {out} is {other[1]}: the export would be written into it; {instead}"
        )
    if (out / MANIFEST_FILE).is_file():
        raise UserError(
            f"--out {out} is one version of an export (it holds {MANIFEST_FILE}); pass its "
            f"base directory, --out {out.parent}"
        )
    existing = next(parent for parent in (out, *out.absolute().parents) if parent.exists())
    if not existing.is_dir():
        raise UserError(f"--out {out}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--out {out}: cannot write in {existing} (permission denied)")
