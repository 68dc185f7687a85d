"""`hybridrec train`: the hybrid loop on a preprocessed dataset (the work is in training.trainer)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import jax

from hybridrec.cli import _flags, _train_follow
from hybridrec.cli._chatter import VERBOSE_ENV, native_output_filtered, quiet_native_logging
from hybridrec.cli._compilation_cache import use_compilation_cache
from hybridrec.cli._embedding_servers import embedding_servers
from hybridrec.training.api import make_trainer
from hybridrec.training.config import load_config
from hybridrec.training.evaluate import describe
from hybridrec.training.profiling import format_summary
from hybridrec.training.run_dir import require_run_dir
from hybridrec.training.run_log import run_name


def _print_summary(summary: dict[str, Any]) -> None:
    evaluation = summary.get("eval") or {}
    lines = [
        "",
        f"training finished: {run_name(summary['run_dir'])}",
        f"  steps           {summary['steps']}  ({summary['samples']:,} samples, "
        f"{summary['processes']} process(es), {summary['devices']} devices)",
        f"  throughput      {summary['samples_per_s'] or 0:,.0f} samples/s"
        + (
            f", {summary['tokens_per_s']:,.0f} positions/s of histories "
            f"({summary['padding_fraction']:.1%} of the rows padding)"
            if summary.get("tokens_per_s")
            else ""
        ),
        f"  staleness       max {summary['staleness_max']} (bound {summary['staleness_bound']})",
    ]
    store = summary.get("embedding_store") or {}
    if store:
        lines.append(
            f"  embeddings      {store.get('rows', 0):,} rows in {store.get('num_shards', 0)} shards, "
            f"{store.get('bytes_held', 0) / 2**20:,.1f} MiB held (ceiling "
            f"{store.get('bytes_at_capacity', 0) / 2**30:,.1f} GiB at capacity), "
            f"{store.get('evicted_lru', 0) + store.get('evicted_ttl', 0):,} evicted, "
            f"{store.get('nonfinite_skipped', 0):,} non-finite updates skipped"
        )
    device_tables = summary.get("device_tables") or {}
    caches = device_tables.get("caches") or {}
    if caches:
        lines.append(
            f"  caches          {len(caches)} hot-row caches on the devices held "
            f"{device_tables['cache_hit_rate']:.1%} of their tables' lookups; "
            f"{sum(c['admitted'] for c in caches.values()):,} rows admitted, "
            f"{sum(c['evicted'] for c in caches.values()):,} evicted (written back)"
        )
    if evaluation:
        lines.append(f"  eval            {describe(evaluation)}")
    best = summary.get("best") or {}
    if best.get("step") is not None:
        lines += [
            f"  best            step {best['step']}: validation {best['metric']} "
            f"{best['value']:.4f}, {best.get('wall_seconds_to_best', 0):,.0f} s after the start "
            f"({best.get('train_seconds_to_best', 0):,.0f} s of training); `evaluate` and "
            "`export` read it",
            f"  stopped         {summary['stopped']}",
        ]
    if summary.get("profile"):
        lines += format_summary(summary["profile"])
    lines += [
        f"  run directory   {summary['run_dir']}",
        f"  metrics         {summary['metrics_file']}",
        f"  tensorboard     {summary['tensorboard_dir']}",
        f"  checkpoint      step {summary['checkpoint_step']} in {summary['run_dir']}/checkpoints",
    ]
    print("\n".join(lines), flush=True)


def main(argv: list[str]) -> int:
    """`hybridrec train`."""
    parser = argparse.ArgumentParser(
        prog="hybridrec train",
        description="Train with the hybrid loop: async embedding store, synchronous dense step.",
    )
    parser.add_argument("--data", help="preprocessed data directory (sets data.path)")
    parser.add_argument("--run-dir", required=True, help="output directory of this run")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start again: delete the run in run-dir once the config and data are checked",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also show the libraries' own logging (Gloo connection lines, XLA C++ logs)",
    )
    _flags.add_config_flags(parser)
    _flags.add_distributed_flags(parser)
    _train_follow.add_flags(parser)
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    overrides = _flags.with_data(args.data, [*args.overrides, *args.positional_overrides])
    use_compilation_cache()
    if args.follow:
        return _train_follow.train_follow(args, run_dir, overrides)
    distributed = _flags.distributed_options(args)
    verbose = args.verbose or os.environ.get(VERBOSE_ENV) == "1"
    if not verbose:
        quiet_native_logging()
    multi_process = (distributed.get("num_processes") or 1) > 1 or bool(distributed.get("cluster"))
    with native_output_filtered(enabled=multi_process and not verbose):
        return _train(args, run_dir, overrides, distributed)


def _train(
    args: argparse.Namespace, run_dir: Path, overrides: list[str], distributed: dict[str, Any]
) -> int:
    if args.resume and args.config is None:
        require_run_dir(run_dir)  # its config.json is the run's config
    config = load_config(args.config, overrides, run_dir if args.resume else None)
    servers = embedding_servers(config.embedding.servers)
    if servers.source.startswith("$") and not args.quiet and (args.process_id or 0) == 0:
        tls = config.embedding.tls
        shown = [  # as dialled: a client with TLS files dials grpc:// as grpc+tls://
            address.replace("grpc://", "grpc+tls://", 1) if tls.ca or tls.cert else address
            for address in servers.addresses
        ]
        print(f"embedding servers from {servers.source}: {', '.join(shown)}")
    trainer = make_trainer(  # the Python API's trainer: one path for both
        config,
        run_dir=run_dir,
        resume=args.resume,
        overwrite=args.overwrite,
        distributed=distributed,
        quiet=args.quiet,
        servers=servers,
    )
    if trainer.is_chief and not args.quiet:
        for choice in trainer.job.choices:
            print(choice, flush=True)
        devices = jax.devices()
        print(
            f"devices: {len(devices)} {devices[0].platform} device(s) in "
            f"{jax.process_count()} process(es)"
            + (
                " (one CPU device is the fastest layout on a CPU host; XLA_FLAGS="
                "--xla_force_host_platform_device_count=N splits the step over N virtual devices)"
                if devices[0].platform == "cpu" and len(devices) == 1
                else ""
            ),
            flush=True,
        )
    stop = _stop_on_signals(trainer.job.process_count)
    summary = trainer.fit(stop)
    if trainer.is_chief:
        _print_summary(summary)
    last = trainer.source.last_step
    if stop.is_set() and last and summary["steps"] < last:
        if trainer.is_chief:
            print(
                f"stopped at step {summary['steps']} of {last}; continue with `hybridrec train "
                f"--resume --run-dir {run_dir}`",
                flush=True,
            )
        # not finished: a scheduler restarts the job (a Kubernetes Job with restartPolicy
        # OnFailure, Slurm --requeue), which then resumes from the checkpoint
        return 128 + stop.signal
    return 0


class _Stop(threading.Event):
    signal = 0  # the first signal that asked for the stop


def _stop_on_signals(process_count: int) -> _Stop:
    """An event SIGTERM and Ctrl-C set: the run stops after its current step, with a
    checkpoint; Ctrl-C twice stops it at once (a SIGTERM after Ctrl-C, as `hybridrec
    launch` sends its children, is the same stop). A job of several processes keeps the
    signals' defaults: a stop on one process alone would leave the others waiting."""
    stop = _Stop()
    if process_count > 1 or threading.current_thread() is not threading.main_thread():
        return stop

    def handler(signum, frame):
        if stop.is_set():
            if signum == signal.SIGINT == stop.signal:
                raise KeyboardInterrupt
            return
        stop.signal = signum
        stop.set()
        name = signal.Signals(signum).name
        print(
            f"hybridrec train: {name}: stopping after this step with a checkpoint"
            + (" (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""),
            file=sys.stderr,
            flush=True,
        )

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler)
    return stop
