"""Starting `hybridrec serve-embeddings` processes and waiting until they serve.

Part of the command layer (the library never starts a hybridrec process): what a local
launcher (`hybridrec launch`, placement runs, tests, benchmarks) uses; in a cluster the
scheduler starts the servers instead (see docs/remote.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from hybridrec.common.errors import UserError
from hybridrec.embedding_store.remote.wire import TOKEN_ENV


def contiguous_shards(server_index: int, num_servers: int, num_shards: int) -> list[int]:
    """The shards server `server_index` of `num_servers` hosts: a contiguous, balanced range."""
    if not 0 <= server_index < num_servers:
        raise UserError(f"--server-index {server_index} outside 0..{num_servers - 1}")
    if num_servers > num_shards:
        raise UserError(f"{num_servers} servers for {num_shards} shards: some would host none")
    start = server_index * num_shards // num_servers
    stop = (server_index + 1) * num_shards // num_servers
    return list(range(start, stop))


class ServerProcess:
    """A `serve-embeddings` subprocess started by `start_server_process`.

    Attributes:
        address: "host:port" clients connect to.
        process: the `subprocess.Popen`.
        shards: the shard indices it hosts.
    """

    def __init__(self, process: subprocess.Popen, address: str, shards: list[int]):
        self.process = process
        self.address = address
        self.shards = shards
        self._terminated = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def terminate(self) -> None:
        """Sends SIGTERM once (the server drains in-flight updates, then exits 0)."""
        if not self._terminated and self.process.poll() is None:
            self._terminated = True
            self.process.terminate()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (drains in-flight updates), then SIGKILL after `timeout`; returns the exit code."""
        if self.process.poll() is None:
            self.terminate()
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()

    def kill(self) -> None:
        """SIGKILL: the fault case (no drain, no goodbye)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def start_server_process(
    tables: str | Path | None = None,
    *,
    num_shards: int,
    shards: Sequence[int] | None = None,
    config: str | Path | None = None,
    data: str | Path | None = None,
    overrides: Sequence[str] = (),
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    restore: str | None = None,
    extra_args: Sequence[str] = (),
    log_path: str | Path | None = None,
    ready_timeout: float = 120.0,
) -> ServerProcess:
    """Starts `hybridrec serve-embeddings` in a subprocess and waits until it is ready.

    Args:
        tables: table-config file (TOML/JSON) or preset holding the tables; or None and
        config / data / overrides: the training preset, data directory and `--set`
            overrides, to host exactly the tables `hybridrec train` builds from them.
        num_shards: total shards across all servers.
        shards: indices this server hosts (default: all).
        host / port: bind address; port 0 picks a free port (see `.address`).
        token: shared secret, passed through the environment (never on the command line).
        restore: checkpoint URL to restore from (latest step; starts empty if none).
        extra_args: more `serve-embeddings` flags, e.g. ["--max-request-mb", "64"].
        log_path: file for the server's stdout/stderr (default: inherit).
        ready_timeout: seconds to wait for readiness.

    Returns:
        A ServerProcess; call `.stop()` (graceful) or `.kill()` when done.

    Raises:
        UserError: the server exited or did not become ready in time (with its log tail).
    """
    arguments = _server_arguments(
        num_shards=num_shards,
        shards=shards,
        tables=tables,
        config=config,
        data=data,
        overrides=overrides,
        host=host,
        port=port,
        restore=restore,
    )
    return _spawn(arguments + list(extra_args), token, log_path).wait_ready(ready_timeout)


def start_servers(
    num_servers: int,
    *,
    num_shards: int,
    tables: str | Path | None = None,
    config: str | Path | None = None,
    data: str | Path | None = None,
    overrides: Sequence[str] = (),
    host: str = "127.0.0.1",
    token: str | None = None,
    restore: str | None = None,
    extra_args: Sequence[str] = (),
    log_dir: str | Path | None = None,
    ready_timeout: float = 120.0,
) -> list[ServerProcess]:
    """Starts `num_servers` servers in parallel, splitting the shards into contiguous ranges.

    Arguments as in `start_server_process`; each server picks a free port and logs to
    `log_dir/embedding-server-<i>.log` (default: inherit the output).

    Returns:
        ServerProcesses in shard order; `[s.address for s in servers]` is the value for
        `embedding.servers`. Stop them with `stop_servers`. If one fails to start, the
        others are killed and the error names its log.
    """
    if num_servers < 1:
        raise UserError(f"need at least one embedding server, got {num_servers}")
    starting: list[_Starting] = []
    try:
        for index in range(num_servers):
            arguments = _server_arguments(
                num_shards=num_shards,
                shards=contiguous_shards(index, num_servers, num_shards),
                tables=tables,
                config=config,
                data=data,
                overrides=overrides,
                host=host,
                port=0,
                restore=restore,
            )
            log_path = Path(log_dir) / f"embedding-server-{index}.log" if log_dir else None
            starting.append(_spawn(arguments + list(extra_args), token, log_path))
        return [pending.wait_ready(ready_timeout) for pending in starting]
    except BaseException:
        for pending in starting:
            pending.kill()
        raise


def stop_servers(servers: Sequence[ServerProcess], timeout: float = 60.0) -> list[int]:
    """SIGTERM to every server at once (each drains), then waits; returns their exit codes."""
    for server in servers:
        server.terminate()
    return [server.stop(timeout) for server in servers]


def _server_arguments(
    *, num_shards, shards, tables, config, data, overrides, host, port, restore
) -> list[str]:
    if (tables is None) == (config is None):
        raise UserError("embedding servers: give either a tables file or a training config")
    arguments = ["--num-shards", str(num_shards), "--host", host, "--port", str(port)]
    if tables is not None:
        arguments += ["--tables", str(tables)]
    else:
        arguments += ["--config", str(config)]
        arguments += ["--data", str(data)] if data else []
        for override in overrides:
            arguments += ["--set", override]
    if shards is not None:
        arguments += ["--shards", ",".join(str(index) for index in shards)]
    if restore:
        arguments += ["--restore", str(restore)]
    return arguments


class _Starting:
    """A spawned server process not yet known to be ready."""

    def __init__(self, process: subprocess.Popen, ready_dir: Path, log_path):
        self.process = process
        self.ready_dir = ready_dir
        self.log_path = log_path

    def wait_ready(self, timeout: float) -> ServerProcess:
        ready_file = self.ready_dir / "ready.json"
        deadline = time.monotonic() + timeout
        try:
            while not ready_file.exists():
                if self.process.poll() is not None:
                    raise UserError(
                        f"embedding server exited with status {self.process.returncode} before "
                        f"it was ready{_log_tail(self.log_path)}"
                    )
                if time.monotonic() > deadline:
                    raise UserError(
                        f"embedding server not ready after {timeout:g} s{_log_tail(self.log_path)}"
                    )
                time.sleep(0.05)
            info = json.loads(ready_file.read_text())
        except BaseException:
            self.kill()
            raise
        finally:
            shutil.rmtree(self.ready_dir, ignore_errors=True)
        return ServerProcess(self.process, info["address"], info["shards"])

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        shutil.rmtree(self.ready_dir, ignore_errors=True)


def _spawn(arguments: list[str], token: str | None, log_path) -> _Starting:
    """Starts `python -m hybridrec serve-embeddings <arguments>` with a ready file."""
    ready_dir = Path(tempfile.mkdtemp(prefix="hybridrec-serve-"))
    command = [sys.executable, "-m", "hybridrec", "serve-embeddings", *arguments]
    command += ["--ready-file", str(ready_dir / "ready.json")]
    environment = dict(os.environ)
    environment.pop(TOKEN_ENV, None)
    if token:
        environment[TOKEN_ENV] = token  # never on the command line (visible in `ps`)
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab") if log_path else None  # noqa: SIM115 (lives with the process)
    try:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT if log else None, env=environment
        )
    finally:
        if log:
            log.close()
    return _Starting(process, ready_dir, log_path)


def _log_tail(log_path: str | Path | None, lines: int = 20) -> str:
    if not log_path or not Path(log_path).exists():
        return ""
    tail = Path(log_path).read_text(errors="replace").splitlines()[-lines:]
    return "; server log:\n" + "\n".join(tail)
