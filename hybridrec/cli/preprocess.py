"""`hybridrec preprocess`: raw click logs -> sharded Parquet + metadata.json (the work is in pipeline).

The flags below belong to the job; every other flag is a Beam pipeline option and goes
to `PipelineOptions` untouched, so any runner's own flags work unchanged. A flag that is
neither is an error, with the closest flag of either kind suggested.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from hybridrec.common.errors import UserError
from hybridrec.pipeline import PreprocessConfig, PreprocessResult, run_preprocess, runners
from hybridrec.pipeline.config import COMPRESSIONS, INPUT_FORMATS, SPLIT_MODES
from hybridrec.pipeline.events.event_spec import spec_kind


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridrec preprocess",
        description=(
            "Raw click logs (TSV/CSV, .gz, Parquet, globs) -> sharded Parquet + metadata.json. "
            "Arguments not listed here are Beam pipeline options (e.g. --project P --region R "
            "--temp_location gs://... with --runner dataflow), passed through untouched."
        ),
    )
    parser.add_argument(
        "--input", "-i", nargs="+", required=True, help="input files or globs, in order"
    )
    parser.add_argument(
        "--output", "-o", required=True, help="output directory (local or gs://, s3://)"
    )
    parser.add_argument("--spec", default="criteo", help="built-in spec name or spec TOML file")
    parser.add_argument("--input-format", choices=INPUT_FORMATS, default="auto",
                        help="auto: .parquet/.pq files are Parquet, others text; or force text/parquet")  # fmt: skip
    parser.add_argument("--split", choices=SPLIT_MODES, default=None,
                        help="click logs: position (default): last --eval-fraction of input lines is eval; hash: by row hash (an event log's spec has its [split])")  # fmt: skip
    parser.add_argument(
        "--eval-fraction",
        type=float,
        default=None,
        help="click logs: fraction of rows for eval (default 0.1)",
    )
    parser.add_argument(
        "--valid-fraction",
        type=float,
        default=None,
        help="click logs: fraction of rows for a 'valid' split that training tunes and stops "
        "on (the lines just before eval's; default 0: none)",
    )
    parser.add_argument("--chunk-mb", type=float, default=32.0,
                        help="uncompressed input is cut into equal chunks of at most this size (MB); .gz files are one chunk each")  # fmt: skip
    parser.add_argument("--block-mb", type=float, default=16.0, help="bytes parsed per batch (MB)")
    parser.add_argument("--bucket-mb", type=float, default=64.0,
                        help="event logs: input MB whose users one worker groups at a time")  # fmt: skip
    parser.add_argument("--compression", choices=COMPRESSIONS, default="zstd", help="Parquet codec")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a complete output directory"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    stream = parser.add_argument_group("follow mode (docs/online.md)")
    stream.add_argument("--follow", action="store_true",
                        help="keep running: each new complete input file becomes a shard of a stream dataset")  # fmt: skip
    stream.add_argument("--stats", metavar="REFERENCE_DATA",
                        help="--follow: a preprocessed dataset whose spec and statistics are applied, frozen")  # fmt: skip
    stream.add_argument("--poll-interval", type=float, default=0.5, help="--follow: seconds between looks")  # fmt: skip
    stream.add_argument("--settle-seconds", type=float, default=0.5,
                        help="--follow: a file must be unchanged this long to count as complete")  # fmt: skip
    stream.add_argument("--grow-timeout", type=float, default=60.0,
                        help="--follow: a file still changing after this many seconds is a dead letter")  # fmt: skip
    stream.add_argument("--marker-suffix", default="",
                        help="--follow: NAME counts once NAME<suffix> exists (e.g. .done)")  # fmt: skip
    stream.add_argument("--max-files-per-run", type=int, default=16,
                        help="--follow: most new files in one bounded Beam run")  # fmt: skip
    stream.add_argument("--max-idle", type=float, default=0.0,
                        help="--follow: stop after this many seconds without a new file (0: run until SIGTERM)")  # fmt: skip
    stream.add_argument("--snapshot-every", type=int, default=50, metavar="FILES",
                        help="--follow on event logs: files between snapshots of the users' kept histories (a restart replays the shards after the newest)")  # fmt: skip
    runner = parser.add_argument_group("runner")
    runner.add_argument("--runner", default="direct",
                        help=f"Beam runner: {', '.join(runners.RUNNER_NAMES)} (any case, 'Runner' suffix optional) or a fully qualified class name")  # fmt: skip
    runner.add_argument("--dask-address", metavar="tcp://HOST:PORT",
                        help="--runner dask: scheduler of a running Dask cluster (default: start a local one)")  # fmt: skip
    runner.add_argument("--dask-workers", type=int, default=0,
                        help="--runner dask without --dask-address: local worker processes (default: cores)")  # fmt: skip
    runner.add_argument("--dask-timeout", type=float, default=10.0,
                        help="--runner dask: seconds to wait for the scheduler to answer")  # fmt: skip
    return parser


def _print_summary(result: PreprocessResult) -> None:
    meta = result.metadata
    counts = meta["counts"]
    rate = counts["rows_read"] / max(result.seconds, 1e-9)
    rejected = ", ".join(f"{k}={v}" for k, v in counts["rejected_by_reason"].items()) or "none"
    train, evaluation = meta["splits"]["train"], meta["splits"]["eval"]
    lines = [
        f"preprocessed {counts['rows_read']:,} rows in {result.seconds:.1f}s ({rate:,.0f} rows/s)",
        f"  written:  train {train['rows']:,} rows in {len(train['files'])} files, "
        f"eval {evaluation['rows']:,} rows in {len(evaluation['files'])} files",
        f"  rejected: {counts['rows_rejected']:,} ({rejected})",
        f"  label rate (train): {meta['stats']['label_rate']:.4f}",
    ]
    if counts["crlf_lines_accepted"]:
        lines.append(f"  note: {counts['crlf_lines_accepted']:,} lines ended in CRLF (accepted)")
    if counts["empty_files"]:
        lines.append(f"  note: empty input files: {', '.join(counts['empty_files'])}")
    lines.append(f"  runner:   {meta['runner']}")
    rejected_dir = "rejected/, " if meta["rejected_files"] else ""
    lines.append(
        f"  output:   {result.output}/ (metadata.json, train/, eval/, {rejected_dir}_SUCCESS)"
    )
    print("\n".join(lines))


def _print_event_summary(result: PreprocessResult) -> None:
    meta = result.metadata
    sequence, rejected = meta["sequence"], meta["rejected"]
    rate = sequence["events_read"] / max(result.seconds, 1e-9)
    reasons = ", ".join(f"{k}={v}" for k, v in rejected["by_reason"].items()) or "none"
    lengths = sequence["history_length"]
    written = ", ".join(
        f"{name} {split['rows']:,} rows in {len(split['files'])} files"
        for name, split in meta["splits"].items()
    )
    lines = [
        f"preprocessed {sequence['events_read']:,} events of {sequence['users']:,} users in "
        f"{result.seconds:.1f}s ({rate:,.0f} events/s)",
        f"  written:  {written}",
        f"  rejected: {rejected['rows']:,} rows ({reasons})",
        f"  dropped:  {sequence['duplicates_dropped']:,} duplicate events, "
        f"{sequence['users_below_min_events']:,} users below min_events",
        f"  cut:      {sequence['truncated_histories']:,} histories to max_length, "
        f"{sequence['capped_users']:,} users to max_events_per_user",
    ]
    if lengths.get("count"):
        lines.append(
            f"  history:  mean {lengths['mean']} events, p50 {lengths['p50']}, p99 "
            f"{lengths['p99']}, max {lengths['max']} (training rows)"
        )
    for user, events in sequence["capped_users_named"][:3]:
        lines.append(f"  capped:   user {user!r} had {events:,} events")
    lines.append(f"  runner:   {meta['runner']}")
    outputs = ", ".join(f"{name}/" for name in meta["splits"])
    outputs += ", rejected/" if rejected["files"] else ""
    lines.append(f"  output:   {result.output}/ (metadata.json, {outputs}, _SUCCESS)")
    print("\n".join(lines))


def main(argv: list[str]) -> int:
    """`hybridrec preprocess`."""
    parser = _parser()
    args, beam_args = parser.parse_known_args(argv)
    own_flags = [option for action in parser._actions for option in action.option_strings]
    runner = runners.resolve_runner(args.runner)
    runners.check_beam_args(beam_args, runner=runner, own_flags=own_flags)
    if args.follow:
        return _follow(args, beam_args)
    if args.stats:
        raise UserError("--stats applies to --follow only")
    events = spec_kind(args.spec) == "events"
    given = [
        flag
        for flag, value in (
            ("--split", args.split),
            ("--eval-fraction", args.eval_fraction),
            ("--valid-fraction", args.valid_fraction),
        )
        if value is not None
    ]
    if events and given:
        flag = given[0]
        raise UserError(
            f"{flag} is for click logs: the event spec {args.spec} splits by its [split] table "
            "(leave_one_out or time windows)"
        )
    config = PreprocessConfig(
        inputs=args.input,
        output=args.output,
        spec=args.spec,
        input_format=args.input_format,
        split=args.split or "position",
        eval_fraction=0.1 if args.eval_fraction is None else args.eval_fraction,
        valid_fraction=args.valid_fraction or 0.0,
        bucket_mb=args.bucket_mb,
        chunk_mb=args.chunk_mb,
        block_mb=args.block_mb,
        compression=args.compression,
        overwrite=args.overwrite,
        runner=args.runner,
        dask_address=args.dask_address,
        dask_workers=args.dask_workers,
        dask_timeout=args.dask_timeout,
    )
    if events:
        from hybridrec.pipeline.events.event_job import run_event_preprocess

        result = run_event_preprocess(config, beam_args=beam_args, quiet=args.quiet)
        _print_event_summary(result)
        return 0
    result = run_preprocess(config, beam_args=beam_args, quiet=args.quiet)
    _print_summary(result)
    return 0


def _follow(args: argparse.Namespace, beam_args: list[str]) -> int:
    """`hybridrec preprocess --follow`: until SIGTERM (or --max-idle), new files -> shards."""
    from hybridrec.pipeline.follow import FollowConfig, follow

    if not args.stats:
        raise UserError("--follow needs --stats REFERENCE_DATA (its spec and statistics are used)")
    if args.valid_fraction is not None:
        raise UserError("--valid-fraction is for a dataset of files, not --follow: a stream trains every row")  # fmt: skip
    config = FollowConfig(
        inputs=args.input,
        output=args.output,
        reference=args.stats,
        poll_interval=args.poll_interval,
        settle_seconds=args.settle_seconds,
        grow_timeout=args.grow_timeout,
        marker_suffix=args.marker_suffix,
        max_files_per_run=args.max_files_per_run,
        block_mb=args.block_mb,
        compression=args.compression,
        snapshot_every=args.snapshot_every,
    )
    stop = threading.Event()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signal_number, lambda *_: stop.set())
    if not args.quiet:
        print(
            f"following {' '.join(args.input)} -> {args.output} (SIGTERM to stop)", file=sys.stderr
        )
    summary = follow(
        config, stop=stop, max_idle=args.max_idle, beam_args=beam_args, quiet=args.quiet
    )
    print(summary.line())
    for source, reason in summary.dead_letters:
        print(f"  dead letter {source}: {reason}")
    folders = ", ".join(f"{folder}/" for folder in summary.folders)
    print(f"  output:   {args.output}/ (manifest.jsonl, {folders})")
    return 0
