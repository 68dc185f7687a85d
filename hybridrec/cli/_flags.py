"""Flags several commands share: config presets and overrides, multi-process coordinates."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from hybridrec.common.errors import UserError


def add_override_flag(parser: argparse.ArgumentParser, help_text: str) -> None:
    """Adds the repeatable `--set KEY=VALUE` flag every command uses for config overrides."""
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help_text
    )


def with_data(data: str | Path | None, overrides: list[str]) -> list[str]:
    """`overrides` with `--data` as `data.path`, first: a `--set` that contradicts it
    (`data=5`) is then the one an error names; `--set data.path` beside it is an error."""
    if not data:
        return list(overrides)
    if given := [o for o in overrides if o.split("=", 1)[0].strip() == "data.path"]:
        raise UserError(f"--data and --set {given[0]}: give the dataset once")
    return [f"data.path={json.dumps(str(data))}", *overrides]


def read_token_file(path: str | Path, flag: str = "--token-file") -> str:
    """The shared secret in the file at `path` (surrounding whitespace ignored)."""
    try:
        token = Path(path).read_text().strip()
    except OSError as error:
        raise UserError(f"{flag} {path}: cannot read the token file ({error.strerror})") from None
    if not token:
        raise UserError(f"{flag} {path}: the token file is empty")
    return token


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
    """The keyword arguments of `model.maybe_initialize_distributed`: the flags, else the
    HYBRIDREC_* variables (`hybridrec launch` sets them), else a detected launcher."""
    layout = distributed_from_environment()
    for key in ("coordinator", "num_processes", "process_id"):
        if getattr(args, key, None) is not None:
            layout[key] = getattr(args, key)
    return layout


# How `hybridrec launch` (or any launcher) tells a process its place in the job.
COORDINATOR_ENV = "HYBRIDREC_COORDINATOR"  # host:port of process 0's coordinator service
NUM_PROCESSES_ENV = "HYBRIDREC_NUM_PROCESSES"  # total number of processes
PROCESS_ID_ENV = "HYBRIDREC_PROCESS_ID"  # this process' index in [0, num_processes)


def distributed_from_environment() -> dict[str, Any]:
    """The multi-process layout from HYBRIDREC_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID,
    and the launcher JAX can detect by itself (Slurm, Open MPI), as keyword arguments of
    `model.maybe_initialize_distributed`."""
    return {
        "coordinator": os.environ.get(COORDINATOR_ENV) or None,
        "num_processes": _environment_int(NUM_PROCESSES_ENV),
        "process_id": _environment_int(PROCESS_ID_ENV),
        "cluster": _detected_cluster(),
    }


def _environment_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def _detected_cluster() -> str | None:
    """A multi-process launcher JAX can read the process layout from, if any."""
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(name in os.environ for name in slurm) and int(os.environ["SLURM_NTASKS"]) > 1:
        return "slurm"
    if (
        "OMPI_MCA_orte_hnp_uri" in os.environ
        and int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    ):
        return "ompi"
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return "jax environment"
    return None


def add_tls_flags(parser: argparse.ArgumentParser, *, cert_help: str, ca_help: str) -> None:
    """`--tls-cert`, `--tls-key` and `--tls-ca` (PEM files; see `hybridrec.common.tls`)."""
    parser.add_argument("--tls-cert", metavar="PEM", help=cert_help)
    parser.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert (PEM)")
    parser.add_argument("--tls-ca", metavar="PEM", help=ca_help)


def checkpoint_step(text: str) -> int | str:
    """--step's value: a checkpoint step, "best" (the kept best, checkpoint.keep_best) or
    "latest" (the newest complete one)."""
    if text in ("best", "latest"):
        return text
    try:
        return int(text)
    except ValueError:
        raise UserError(f"--step {text!r} is neither a step number, 'best' nor 'latest'") from None
