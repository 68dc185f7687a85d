"""`hybridrec train --follow DATA`: the flags of follow mode and its run (training.trainer with a stream source).

The command layer wires publishing: the trainer (training/) cannot import serving/, so
it is handed `serving.export_run` as its `publish` callable here.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from hybridrec.cli._flags import checkpoint_step
from hybridrec.common.errors import UserError
from hybridrec.training.config import load_config


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of follow mode (on `hybridrec train`)."""
    group = parser.add_argument_group("follow mode (docs/online.md)")
    group.add_argument("--follow", metavar="DATA",
                       help="a stream dataset (`preprocess --follow` output): train on its shards as they arrive, until SIGTERM")  # fmt: skip
    group.add_argument("--checkpoint-every", type=float, default=30.0, metavar="SECONDS",
                       help="--follow: seconds between checkpoints")  # fmt: skip
    group.add_argument("--publish-every", type=float, default=0.0, metavar="SECONDS",
                       help="--follow: seconds between exports to --export (0: only at the end)")  # fmt: skip
    group.add_argument("--export", metavar="DIR",
                       help="--follow: export base directory for `hybridrec serve --watch` (default RUN_DIR/export)")  # fmt: skip
    group.add_argument("--export-precision", default="fp32", choices=("fp32", "fp16", "int8"),
                       help="--follow: embedding rows of the exports")  # fmt: skip
    group.add_argument("--keep-exports", type=int, default=3,
                       help="--follow: export versions kept besides those the newest is a delta of")  # fmt: skip
    group.add_argument("--full-export-every", type=int, default=10, metavar="N",
                       help="--follow: exports are deltas of the previous one (changed rows + tower), every N-th full; 1: always full")  # fmt: skip
    group.add_argument("--flush-after", type=float, default=1.0, metavar="SECONDS",
                       help="--follow: without a new shard this long, train the rows short of a batch")  # fmt: skip
    group.add_argument("--max-idle", type=float, default=0.0, metavar="SECONDS",
                       help="--follow: stop after this long without a new shard (0: run until SIGTERM)")  # fmt: skip
    group.add_argument("--init-from", metavar="RUN_DIR", type=Path,
                       help="--follow: start from this run's checkpoint (e.g. a batch run on the stream's reference data) instead of a new model")  # fmt: skip
    group.add_argument("--init-step", type=checkpoint_step, metavar="STEP",
                       help="--init-from: its checkpoint step, or 'best' (default: its newest)")  # fmt: skip


def train_follow(args: argparse.Namespace, run_dir: Path, overrides: list[str]) -> int:
    """Runs the trainer on a stream until SIGTERM / SIGINT (or --max-idle); prints its summary."""
    from hybridrec.cli._embedding_servers import embedding_servers
    from hybridrec.serving.delta import delta_base, prune_versions
    from hybridrec.serving.export import export_run
    from hybridrec.training.follow_run import FollowOptions
    from hybridrec.training.trainer import Trainer

    if args.data:
        raise UserError("--follow DATA replaces --data; give one of them")
    overrides = [*overrides, f"data.path={json.dumps(str(args.follow))}"]
    config = load_config(args.config, overrides, run_dir if args.resume else None)
    export_dir = Path(args.export or run_dir / "export")

    def publish(step: int) -> dict:
        result = export_run(
            run_dir,
            export_dir,
            step=step,
            precision=args.export_precision,
            quiet=True,
            delta_from=delta_base(export_dir, args.full_export_every),
        )
        prune_versions(export_dir, args.keep_exports)
        return result

    trainer = Trainer(
        config,
        run_dir,
        follow=FollowOptions(
            checkpoint_every=args.checkpoint_every,
            publish_every=args.publish_every,
            flush_after=args.flush_after,
            max_idle=args.max_idle,
            init_from=args.init_from,
            init_step=args.init_step,
        ),
        publish=publish,
        resume=args.resume,
        overwrite=args.overwrite,
        quiet=args.quiet,
        servers=embedding_servers(config.embedding.servers),
    )
    stop = threading.Event()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signal_number, lambda *_: stop.set())
    if not args.quiet:
        for choice in trainer.job.choices:
            print(choice, flush=True)
        print(
            f"training on {args.follow} as shards arrive (batch {trainer.config.data.batch_size}); "
            f"exports to {export_dir}; SIGTERM to stop",
            file=sys.stderr,
            flush=True,
        )
    summary = trainer.fit(stop)
    print(
        f"follow training stopped: {summary['rows_trained']:,} {summary.get('unit', 'rows')} in {summary['steps']} steps "
        f"from {summary['position']['shard']} complete shards of {summary['shards_seen']}; "
        f"checkpoint step {summary['checkpoint_step']} in {run_dir}/checkpoints; exports in "
        f"{export_dir}",
        flush=True,
    )
    return 0
