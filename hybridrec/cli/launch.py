"""`hybridrec launch`: run a hybridrec command as N cooperating processes on this machine.

Each process gets its own CPU devices (`--devices-per-process`), or with
JAX_PLATFORMS=cuda (rocm) its own GPUs: process i sees GPUs [i * d, (i + 1) * d) of
those the host shows (CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`). The JAX coordinator
runs in process 0 on 127.0.0.1 at a free port, and the layout reaches each process
through HYBRIDREC_COORDINATOR / HYBRIDREC_NUM_PROCESSES / HYBRIDREC_PROCESS_ID, which
`model.maybe_initialize_distributed` reads. Under Slurm or Kubernetes the same
`hybridrec train ...` command runs unchanged with those variables (or Slurm's own)
set by the scheduler; see docs/training.md.

With `--embedding-servers M` it first starts M `hybridrec serve-embeddings` processes
hosting the tables the train command builds (same --config / --data / --set), passes
their addresses to every process as `embedding.servers`, and stops them at the end:
the PERSIA layout (shared embedding servers, data-parallel trainers) on one machine.
With `--tls-cert/--tls-key` (and `--tls-ca` for client certificates) those servers serve
over TLS; the train command's own `embedding.tls.*` settings say how the trainers verify
them (its `embedding.tls.ca`) and which client certificate they present.

Example:
    hybridrec launch -n 2 -- train --data runs/data --run-dir runs/two --config quickstart
    hybridrec launch -n 2 --embedding-servers 2 -- train --data runs/data --run-dir runs/r2 ...
    hybridrec launch -n 2 --embedding-servers 2 --tls-cert server.pem --tls-key server.key \
        -- train ... --set embedding.tls.ca=ca.pem
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from hybridrec.cli import _flags
from hybridrec.cli._chatter import QUIET_ENVIRONMENT, VERBOSE_ENV, is_chatter
from hybridrec.common.errors import UserError
from hybridrec.common.tls import TLSFiles


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# GPU platforms of JAX_PLATFORMS -> the variable that picks the GPUs a process sees
VISIBLE_GPUS = {
    "cuda": "CUDA_VISIBLE_DEVICES",
    "gpu": "CUDA_VISIBLE_DEVICES",
    "rocm": "HIP_VISIBLE_DEVICES",
}


def gpu_platform(env: dict[str, str]) -> str | None:
    """The GPU platform JAX_PLATFORMS asks for first, or None (CPU devices)."""
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    return platforms[0] if platforms and platforms[0] in VISIBLE_GPUS else None


def host_gpus(env: dict[str, str], platform: str) -> list[str] | None:
    """The GPUs processes on this host may use (ids for the visibility variable): the
    variable's list where it is set, else `nvidia-smi -L`'s GPUs; None when unknown."""
    visible = env.get(VISIBLE_GPUS[platform])
    if visible is not None:
        return [gpu.strip() for gpu in visible.split(",") if gpu.strip()]
    if platform == "rocm":
        return None
    try:
        listed = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [str(i) for i, line in enumerate(listed.splitlines()) if line.startswith("GPU ")]


def process_environment(
    process_id: int,
    num_processes: int,
    coordinator: str,
    devices_per_process: int,
    gpus: list[str] | None = None,
) -> dict[str, str]:
    """The environment of process `process_id` of a local multi-process job; with `gpus`
    (JAX_PLATFORMS naming a GPU platform) the process sees its own slice of them."""
    env = dict(os.environ)
    platform = gpu_platform(env)
    if platform and gpus is not None:
        share = gpus[process_id * devices_per_process : (process_id + 1) * devices_per_process]
        env[VISIBLE_GPUS[platform]] = ",".join(share)
    flags = [
        flag
        for flag in env.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
    env.update(
        XLA_FLAGS=" ".join(flags),
        HYBRIDREC_COORDINATOR=coordinator,
        HYBRIDREC_NUM_PROCESSES=str(num_processes),
        HYBRIDREC_PROCESS_ID=str(process_id),
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _relay(stream, prefix: str, target, verbose: bool = False) -> None:
    """Copies a process's output lines to `target` with `prefix`, without library chatter
    (Gloo's connection lines) unless `verbose`."""
    for line in iter(stream.readline, ""):
        if not verbose and is_chatter(line):
            continue
        target.write(prefix + line)
        target.flush()
    stream.close()


_ASK_THE_HOST = object()


def launch(
    command: list[str],
    *,
    num_processes: int,
    devices_per_process: int,
    timeout: float | None = None,
    verbose: bool = False,
    gpus: Any = _ASK_THE_HOST,
) -> int:
    """Runs `hybridrec <command>` as `num_processes` processes; returns the first failure's code.

    Output of process 0 is passed through; other processes' lines are prefixed with
    `[pN]`. Library chatter (Gloo's connection lines, XLA's C++ logging) is left out
    unless `verbose`. When one process fails, the others are stopped. `gpus`: what
    `host_gpus` says for JAX_PLATFORMS' GPU platform (None: CPU devices), when the caller
    has already asked.
    """
    if num_processes < 1 or devices_per_process < 1:
        raise UserError("--num-processes and --devices-per-process must be >= 1")
    if not command:
        raise UserError("nothing to launch: give a hybridrec command after --, e.g. -- train ...")
    platform = gpu_platform(dict(os.environ))
    if gpus is _ASK_THE_HOST:
        gpus = host_gpus(dict(os.environ), platform) if platform else None
    if gpus is not None and num_processes * devices_per_process > len(gpus):
        raise UserError(
            f"{num_processes} processes x {devices_per_process} devices need "
            f"{num_processes * devices_per_process} GPUs, and JAX_PLATFORMS={platform} on this "
            f"host sees {len(gpus)}; lower --num-processes or --devices-per-process, or unset "
            "JAX_PLATFORMS for CPU devices"
        )
    coordinator = f"127.0.0.1:{free_port()}"
    processes: list[subprocess.Popen] = []
    relays: list[threading.Thread] = []
    for process_id in range(num_processes):
        env = process_environment(process_id, num_processes, coordinator, devices_per_process, gpus)
        if verbose:
            env[VERBOSE_ENV] = "1"
        else:
            env = {**QUIET_ENVIRONMENT, **env}  # a level the user set still wins
        child = subprocess.Popen(
            [sys.executable, "-m", "hybridrec", *command],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        processes.append(child)
        prefix = "" if process_id == 0 else f"[p{process_id}] "
        for stream, target in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
            relay = threading.Thread(
                target=_relay,
                args=(stream, prefix, target, verbose),
                daemon=True,
            )
            relay.start()
            relays.append(relay)
    deadline = None if timeout is None else time.monotonic() + timeout
    status = 0
    try:
        while True:
            codes = [child.poll() for child in processes]
            failed = [code for code in codes if code not in (None, 0)]
            if failed:
                status = failed[0]
                break
            if all(code == 0 for code in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                status = 124
                print(f"hybridrec launch: timed out after {timeout:.0f} s", file=sys.stderr)
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        status = 130
    finally:
        for child in processes:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in processes:
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        for relay in relays:
            relay.join(timeout=5)
    return status


def _train_config_arguments(command: list[str]) -> tuple[str | None, str | None, list[str]]:
    """The --config, --data and overrides of a `train ...` command."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config")
    parser.add_argument("--data")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    known, rest = parser.parse_known_args(command[1:])
    overrides = [
        *known.overrides,
        *(item for item in rest if "=" in item and not item.startswith("-")),
    ]
    return known.config, known.data, overrides


def launch_with_servers(
    command: list[str],
    *,
    num_servers: int,
    num_shards: int,
    log_dir: str | None,
    tls: TLSFiles | None = None,
    **launch_args,
) -> int:
    """Starts embedding servers for a `train` command, runs `launch`, then stops them.

    With `tls` the servers serve over TLS (`serve-embeddings --tls-*`)."""
    from hybridrec.cli.server_processes import start_servers, stop_servers
    from hybridrec.embedding_store.remote.wire import TOKEN_ENV

    if command[:1] != ["train"]:
        raise UserError("--embedding-servers works with the train command")
    preset, data, overrides = _train_config_arguments(command)
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    if preset is None:
        raise UserError("--embedding-servers needs the train command's --config")
    tls_arguments = []
    if tls is not None:
        tls.check_server()
        for part in ("cert", "key", "ca"):
            if getattr(tls, part):
                tls_arguments += [tls.name(part), os.path.abspath(getattr(tls, part))]
    servers = start_servers(
        num_servers,
        num_shards=num_shards,
        config=preset,
        data=data,
        overrides=overrides,
        token=os.environ.get(TOKEN_ENV) or None,  # the secret the trainers will send
        extra_args=tls_arguments,
        log_dir=log_dir,
    )
    try:
        addresses = ", ".join(f'"{server.address}"' for server in servers)
        print(f"hybridrec launch: embedding servers at {addresses}", file=sys.stderr, flush=True)
        settings = [f"embedding.servers=[{addresses}]", f"embedding.num_shards={num_shards}"]
        return launch([*command, *(f"--set={setting}" for setting in settings)], **launch_args)
    finally:
        stop_servers(servers)


def main(argv: list[str]) -> int:
    """`hybridrec launch`."""
    parser = argparse.ArgumentParser(
        prog="hybridrec launch",
        description="Run a hybridrec command (default: train) as N processes on this machine, "
        "with a JAX coordinator on 127.0.0.1 and gloo collectives.",
    )
    parser.add_argument("-n", "--num-processes", type=int, default=2, help="processes to start")
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=0,
        help="devices per process: CPU devices, or GPUs with JAX_PLATFORMS=cuda (default: 8 "
        "CPU devices or the host's GPUs, split over the processes; at least 1)",
    )
    parser.add_argument("--timeout", type=float, help="stop everything after this many seconds")
    parser.add_argument(
        "--embedding-servers",
        type=int,
        default=0,
        help="start this many embedding shard servers for the train command (0: none)",
    )
    parser.add_argument(
        "--embedding-shards",
        type=int,
        default=0,
        help="shards over all servers (default 2 per server)",
    )
    parser.add_argument("--server-logs", help="directory for the servers' logs (default: inherit)")
    _flags.add_tls_flags(
        parser,
        cert_help="with --embedding-servers: their certificate (PEM, valid for 127.0.0.1); "
        "they serve over TLS",
        ca_help="with --embedding-servers: they require client certificates signed by this CA",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also show the libraries' own logging (Gloo connection lines, XLA C++ logs)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- <hybridrec command and args>")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    platform = gpu_platform(dict(os.environ))
    gpus = host_gpus(dict(os.environ), platform) if platform else None
    devices = args.devices_per_process or max(
        1, (8 if gpus is None else len(gpus)) // args.num_processes
    )
    launch_args = dict(
        num_processes=args.num_processes,
        devices_per_process=devices,
        timeout=args.timeout,
        verbose=args.verbose,
        gpus=gpus,  # nvidia-smi is asked once
    )
    tls = TLSFiles.from_flags(args)
    if args.embedding_servers:
        return launch_with_servers(
            command,
            num_servers=args.embedding_servers,
            num_shards=args.embedding_shards or 2 * args.embedding_servers,
            log_dir=args.server_logs,
            tls=tls,
            **launch_args,
        )
    if tls is not None:
        raise UserError("--tls-cert, --tls-key and --tls-ca go with --embedding-servers")
    return launch(command, **launch_args)
