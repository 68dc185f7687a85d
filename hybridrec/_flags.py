"""Flags several commands share: config presets and overrides, multi-process coordinates."""

from __future__ import annotations

import argparse
from typing import Any


def add_override_flag(parser: argparse.ArgumentParser, help_text: str) -> None:
    """Adds the repeatable `--set KEY=VALUE` flag every command uses for config overrides."""
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help_text
    )


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """`--config PRESET`, `--set KEY=VALUE` and trailing `KEY=VALUE` overrides."""
    parser.add_argument("--config", help="preset name (training/configs) or TOML file")
    add_override_flag(parser, "override a config key, e.g. --set hybrid.staleness=0 (repeatable)")
    parser.add_argument(
        "positional_overrides", nargs="*", metavar="KEY=VALUE", help="more overrides"
    )


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    """Where this process sits in a multi-process job."""
    parser.add_argument("--coordinator", help="host:port of process 0 (multi-process jobs)")
    parser.add_argument("--num-processes", type=int, help="processes in the job")
    parser.add_argument("--process-id", type=int, help="this process's index")


def distributed_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of `model.maybe_initialize_distributed` from the flags."""
    return {
        "coordinator": args.coordinator,
        "num_processes": args.num_processes,
        "process_id": args.process_id,
    }
