"""`hybridrec generate`: synthetic click logs in the raw Criteo TSV layout (pipeline.generate),
or with `--events` an event log of users' actions (pipeline.events.synthetic_events)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridrec.common.errors import UserError
from hybridrec.pipeline import generate


def main(argv: list[str]) -> int:
    """`hybridrec generate`."""
    parser = argparse.ArgumentParser(
        prog="hybridrec generate",
        description="Write synthetic click logs in the raw Criteo TSV layout.",
    )
    parser.add_argument(
        "--output", "-o", required=True, help="output file (.gz: gzip); --events: a directory"
    )
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
    events = parser.add_argument_group("event logs (--events)")
    events.add_argument("--events", action="store_true",
                        help="write an event log (events.csv, items.csv and its spec events.toml) into --output")  # fmt: skip
    events.add_argument("--users", type=int, default=10_000, help="users")
    events.add_argument("--items", type=int, default=5_000, help="items")
    events.add_argument("--topics", type=int, default=50, help="item topics")
    events.add_argument("--mean-events", type=float, default=30.0, help="mean events a user")
    events.add_argument("--max-events", type=int, default=2_000, help="events a user at most")
    events.add_argument("--days", type=int, default=None,
                        help="days the users start over (yambda: the days the events span; default 60, yambda 30)")  # fmt: skip
    events.add_argument(
        "--profile", choices=("default", "yambda"), default="default",
        help="yambda: a music-streaming log shaped like Yambda, MLPerf DLRMv4's data (--items "
        "are its tracks; events.csv, tracks.csv and events.toml)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.profile == "yambda" and not args.events:
        parser.error("--profile yambda is an event log: give --events too")
    if args.events:
        return PROFILES[args.profile](args)
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


def _events(args: argparse.Namespace) -> int:
    from hybridrec.pipeline.events.synthetic_events import (
        EventLogConfig,
        generate_events,
        spec_text,
    )

    config = EventLogConfig(
        users=args.users,
        items=args.items,
        topics=args.topics,
        mean_events=args.mean_events,
        max_events=args.max_events,
        days=args.days or 60,
        seed=args.seed,
    )
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    suffix = ".csv.gz" if args.gzip else ".csv"
    summary = generate_events(out / f"events{suffix}", out / "items.csv", config)
    (out / "events.toml").write_text(spec_text("items.csv"))
    rate = summary["events"] / max(summary["seconds"], 1e-9)
    print(
        f"wrote {summary['events']:,} events of {summary['users']:,} users on "
        f"{summary['items']:,} items ({summary['bytes'] / 1e6:.1f} MB) in "
        f"{summary['seconds']:.1f}s ({rate:,.0f} events/s)\n"
        + _written(summary["events_path"], ("items", summary["items_path"]), out / "events.toml")
    )
    return 0


def _yambda(args: argparse.Namespace) -> int:
    from hybridrec.pipeline.events.synthetic_yambda import (
        YambdaConfig,
        generate_yambda,
        yambda_spec_text,
    )

    try:
        config = YambdaConfig(
            users=args.users,
            tracks=args.items,
            mean_events=args.mean_events,
            max_events=args.max_events,
            days=args.days or 30,
            seed=args.seed,
        )
    except ValueError as error:
        raise UserError(f"generate --profile yambda: {error}") from None
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    events = out / ("events.csv.gz" if args.gzip else "events.csv")
    summary = generate_yambda(events, out / "tracks.csv", config)
    (out / "events.toml").write_text(yambda_spec_text("tracks.csv"))
    rate = summary["events"] / max(summary["seconds"], 1e-9)
    print(
        f"wrote {summary['events']:,} events of {summary['users']:,} users on "
        f"{summary['tracks']:,} tracks ({summary['artists']:,} artists, {summary['albums']:,} "
        f"albums; {summary['bytes'] / 1e6:.1f} MB) in {summary['seconds']:.1f}s ({rate:,.0f} "
        f"events/s)\n"
        f"  listens   {summary['listens']:,}, listen_plus {summary['listen_plus_rate']:.1%}, "
        f"organic {summary['organic_rate']:.1%} of the events\n"
        f"  oracle    AUC {summary['oracle_auc']:.4f} of listen_plus for a model that knows "
        "how the log was made\n"
        + _written(events, ("tracks", out / "tracks.csv"), out / "events.toml")
    )
    return 0


def _written(events, items: tuple, spec: Path) -> str:
    """The lines naming a generated event log's files, and the command that preprocesses it."""
    return (
        f"  events    {events}\n  {items[0]:<9} {items[1]}\n  spec      {spec}\n"
        f"  next      hybridrec preprocess --input {events} --spec {spec} --output DATA_DIR"
    )


PROFILES = {"default": _events, "yambda": _yambda}  # --events --profile -> its generator
