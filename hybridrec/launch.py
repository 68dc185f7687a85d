"""`hybridrec launch`: run a hybridrec command as N cooperating processes on this machine.

Each process gets its own CPU devices (`--devices-per-process`), the JAX coordinator
runs in process 0 on 127.0.0.1 at a free port, and the layout reaches each process
through HYBRIDREC_COORDINATOR / HYBRIDREC_NUM_PROCESSES / HYBRIDREC_PROCESS_ID, which
`model.maybe_initialize_distributed` reads. Under Slurm or Kubernetes the same
`hybridrec train ...` command runs unchanged with those variables (or Slurm's own)
set by the scheduler; see docs/training.md.

Example:
    hybridrec launch -n 2 -- train --data runs/data --run-dir runs/two --config quickstart
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

from hybridrec.errors import UserError


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_environment(
    process_id: int, num_processes: int, coordinator: str, devices_per_process: int
) -> dict[str, str]:
    """The environment of process `process_id` of a local multi-process job."""
    env = dict(os.environ)
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


def _relay(stream, prefix: str, target) -> None:
    for line in iter(stream.readline, ""):
        target.write(prefix + line)
        target.flush()
    stream.close()


def launch(
    command: list[str],
    *,
    num_processes: int,
    devices_per_process: int,
    timeout: float | None = None,
) -> int:
    """Runs `hybridrec <command>` as `num_processes` processes; returns the first failure's code.

    Output of process 0 is passed through; other processes' lines are prefixed with
    `[pN]`. When one process fails, the others are stopped.
    """
    if num_processes < 1 or devices_per_process < 1:
        raise UserError("--num-processes and --devices-per-process must be >= 1")
    if not command:
        raise UserError("nothing to launch: give a hybridrec command after --, e.g. -- train ...")
    coordinator = f"127.0.0.1:{free_port()}"
    processes: list[subprocess.Popen] = []
    relays: list[threading.Thread] = []
    for process_id in range(num_processes):
        env = process_environment(process_id, num_processes, coordinator, devices_per_process)
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
            relay = threading.Thread(target=_relay, args=(stream, prefix, target), daemon=True)
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
        help="CPU devices per process (default: 8 / num-processes, at least 1)",
    )
    parser.add_argument("--timeout", type=float, help="stop everything after this many seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- <hybridrec command and args>")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    devices = args.devices_per_process or max(1, 8 // args.num_processes)
    return launch(
        command, num_processes=args.num_processes, devices_per_process=devices, timeout=args.timeout
    )
