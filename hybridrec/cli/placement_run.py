"""One run of the DMT placement comparison: the trainer processes and their servers.

`launch` starts, per host, its embedding server(s) and then the trainer processes (one
per host, `python -m hybridrec.cli.placement_run`, a multi-process JAX job), and returns
every process's record (`training.learned.placement.train` and `evaluate`): flat data-parallel
DLRM or DMT with tables spread over every server, or tower-parallel DMT with each
tower's tables on its own host's server. Hosts are simulated on one machine by process
groups: bytes to a server of another host are what a real cluster moves between hosts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from hybridrec.cli.server_processes import start_server_process, stop_servers
from hybridrec.common.errors import ConfigError, UserError
from hybridrec.embedding_store import EmbeddingStore
from hybridrec.embedding_store.remote.client import connect
from hybridrec.model import (
    create_train_state,
    make_eval_step,
    make_mesh,
    make_train_step,
    maybe_initialize_distributed,
    tower_parallel,
)
from hybridrec.model.config import MeshConfig
from hybridrec.pipeline import read_metadata
from hybridrec.training.config import load_config
from hybridrec.training.data.input import ParquetReader
from hybridrec.training.defaults import resolve_auto
from hybridrec.training.layouts import FlatLayout, TowerLayout
from hybridrec.training.learned.placement import (
    evaluate,
    tower_of_process,
    tower_table_plans,
    train,
)
from hybridrec.training.tables import plan_tables


def write_tables_file(path, tables: Sequence[Any]) -> None:
    """A `serve-embeddings --tables` file (JSON) holding exactly `tables`."""
    Path(path).write_text(json.dumps({"tables": [dataclasses.asdict(t) for t in tables]}))


def check_servers(servers: Any) -> list[list[str]]:
    """`servers` as per-host address lists; a one-line error for any other shape."""
    if (
        not isinstance(servers, list)
        or not servers
        or not all(isinstance(group, list) and group for group in servers)
        or not all(isinstance(address, str) for group in servers for address in group)
    ):
        raise UserError(
            "servers: expected a non-empty JSON list of per-host address lists, e.g. "
            f'[["127.0.0.1:7001"], ["127.0.0.1:7002"]]; got {json.dumps(servers)[:200]}'
        )
    return servers


@dataclasses.dataclass
class _Placement:
    """What one process trains with: its layout, steps, tables and servers."""

    layout: Any
    train_step: Any
    eval_step: Any
    plan: Any
    addresses: list[str]  # the servers this process's store uses
    group: list[str]  # of those, the ones of its tower group (flat: its host's)


def _placement(mode, config, features, servers, host) -> _Placement:
    names = [feature.name for feature in features]
    batch_size = config.data.batch_size
    if mode == "flat":
        mesh = make_mesh(MeshConfig(shape=(-1,), axis_names=("data",)))
        return _Placement(
            layout=FlatLayout.of_process(mesh, batch_size, names),
            train_step=make_train_step(mesh),
            eval_step=make_eval_step(mesh),
            plan=plan_tables(config.embedding, features),
            addresses=[address for group in servers for address in group],
            group=servers[host],
        )
    towers = tuple(tuple(tower) for tower in config.model.towers)
    if not towers:
        raise ConfigError("the tower-parallel layout needs model.towers")
    process, processes = jax.process_index(), jax.process_count()
    tower = tower_of_process(process, processes, len(towers))
    if len(servers) % len(towers):
        raise ConfigError(f"{len(servers)} hosts do not split into {len(towers)} tower groups")
    plan = tower_table_plans(config.embedding, features, towers)[tower]
    mesh = tower_parallel.make_tower_mesh(len(towers))
    layout = TowerLayout(mesh, towers, names, batch_size)
    if layout.tower != tower:
        raise ConfigError(f"process {process}'s devices are not in tower {tower}'s group")
    per_tower = len(servers) // len(towers)
    group = [address for hosts in servers[tower * per_tower :][:per_tower] for address in hosts]
    return _Placement(
        layout=layout,
        train_step=tower_parallel.make_tower_parallel_train_step(mesh, towers),
        eval_step=tower_parallel.make_tower_parallel_eval_step(mesh, towers),
        plan=plan,
        addresses=group,
        group=group,
    )


def run_process(
    *,
    mode: str,
    data: str,
    preset: str,
    overrides: Sequence[str],
    servers: Sequence[Sequence[str]],
    distributed: Mapping[str, Any] | None,
    steps: int | None,
    eval_batches: int | None,
) -> dict[str, Any]:
    """One trainer process of a placement run (`python -m hybridrec.cli.placement_run`).

    Args:
        mode: "flat" (data-parallel over every server) or "towers" (tower-parallel).
        data: a preprocessed dataset.
        preset / overrides: the training config (`model.towers` set for a DMT model).
        servers: per host, the addresses of its embedding servers; process p runs on
            host p * hosts // processes. Flat: the tables are spread over all of them;
            towers: tower t's tables are on host group t's servers.
        distributed: coordinator / num_processes / process_id, or None for one process.
        steps: global batches to train (None: one epoch).
        eval_batches: eval batches (None: the whole eval split).
    """
    servers = check_servers(servers)
    maybe_initialize_distributed(**(distributed or {}))
    config = load_config(preset, list(overrides))
    metadata = read_metadata(data)
    config, _ = resolve_auto(config, metadata, jax.process_count())
    features = [f for f in metadata.categorical if not f.multi_valued]
    if len(features) != len(metadata.categorical):
        raise ConfigError("the placement run reads single-valued features only")
    host = jax.process_index() * len(servers) // jax.process_count()
    placed = _placement(mode, config, features, servers, host)
    shards = connect(placed.addresses, list(placed.plan.tables), retry_timeout=60.0)
    store = EmbeddingStore(list(placed.plan.tables), num_shards=len(shards), shards=shards)
    try:
        state = create_train_state(
            config.model,
            config.optimizer,
            placed.layout.mesh,
            config.seed,
            num_dense=len(metadata.dense_columns),
            num_features=len(features),
            embedding_dim=config.embedding.dim,
        )
        reader = ParquetReader.of_dataset(
            metadata,
            metadata.split_files(config.data.train_split),
            batch_size=config.data.batch_size,
            seed=config.seed,
            shuffle_buffer=config.data.shuffle_buffer,
        )
        steps = reader.batches_per_epoch if steps is None else steps
        common = {"layout": placed.layout, "store": store}
        common["feature_tables"] = placed.plan.feature_tables
        state, record = train(
            reader.batches(steps),
            state=state,
            train_step=placed.train_step,
            local_servers=servers[host],
            group_servers=placed.group,
            steps=steps,
            **common,
        )
        eval_reader = ParquetReader.of_dataset(
            metadata,
            metadata.split_files(config.data.eval_split),
            batch_size=config.data.batch_size,
            pad_final=True,
        )
        record["eval"] = evaluate(
            eval_reader.batches(eval_batches), state=state, eval_step=placed.eval_step, **common
        )
    finally:
        store.close()
    record.update(
        mode=mode,
        process=jax.process_index(),
        host=host,
        tower=getattr(placed.layout, "tower", None),
        batch_size=config.data.batch_size,
        steps=steps,
        dense_params=int(sum(leaf.size for leaf in jax.tree.leaves(state.params))),
    )
    return record


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hybridrec.cli.placement_run",
        description=run_process.__doc__.splitlines()[0],
    )
    parser.add_argument("--mode", choices=("flat", "towers"), required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--config", default="criteo_dlrm")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument(
        "--servers", required=True, help='JSON: per host, its servers: [["127.0.0.1:7001"], ...]'
    )
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--eval-batches", type=int)
    parser.add_argument("--out", required=True, help="JSON file for this process's record")
    args = parser.parse_args(argv)
    distributed = None
    if args.coordinator:
        distributed = {
            "coordinator": args.coordinator,
            "num_processes": args.num_processes,
            "process_id": args.process_id,
        }
    try:
        servers = json.loads(args.servers)
    except json.JSONDecodeError as error:
        parser.error(f"--servers is not JSON: {error}")
    try:
        record = run_process(
            mode=args.mode,
            data=args.data,
            preset=args.config,
            overrides=args.overrides,
            servers=servers,
            distributed=distributed,
            steps=args.steps,
            eval_batches=args.eval_batches,
        )
    except (UserError, ConfigError) as error:
        print(f"placement_run: error: {error}", file=sys.stderr)
        sys.exit(2)
    Path(args.out).write_text(json.dumps(record))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tee(stream, log_path: Path) -> threading.Thread:
    """Copies a child's output to `log_path` and to this process's stderr."""

    def copy():
        with open(log_path, "w") as log:
            for line in stream:
                log.write(line)
                log.flush()
                sys.stderr.write(line)

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def _start_servers(mode, config, features, hosts, workdir) -> list:
    """One server per host: flat, the run's tables (one shard each); towers, its tower's."""
    if mode == "towers":
        towers = config.model.towers
        if not towers or hosts % len(towers):
            raise ConfigError(
                f"the tower-parallel layout needs model.towers and a host count that divides "
                f"by the tower count; got {len(towers)} towers, {hosts} hosts"
            )
        plans = tower_table_plans(config.embedding, features, towers)
        per_tower = hosts // len(towers)
        layout = [(plans[h // per_tower].tables, per_tower, h % per_tower) for h in range(hosts)]
    else:
        tables = plan_tables(config.embedding, features).tables
        layout = [(tables, hosts, h) for h in range(hosts)]
    servers = []
    try:
        for host, (tables, num_shards, shard) in enumerate(layout):
            tables_file = workdir / f"tables-{mode}-{host}.json"
            write_tables_file(tables_file, tables)
            servers.append(
                start_server_process(
                    tables_file,
                    num_shards=num_shards,
                    shards=[shard],
                    log_path=workdir / f"server-{mode}-{host}.log",
                )
            )
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def launch(
    *,
    mode: str,
    data: str | Path,
    preset: str,
    overrides: Sequence[str],
    hosts: int,
    steps: int | None = None,
    eval_batches: int | None = None,
    workdir: str | Path | None = None,
    timeout: float = 3600.0,
) -> list[dict[str, Any]]:
    """Runs one placement run on `hosts` simulated hosts; returns the records by process.

    Each host runs one embedding server and one trainer process (one CPU device each,
    so that every collective crosses processes). Flat: the run's tables are spread over
    the `hosts` servers (one shard each). Towers: host h serves tower h * T // hosts,
    whose tables its tower group's servers hold (one shard per server). Process 0's
    output is shown here and every process's is kept in `workdir`; when a process fails
    (or `timeout` seconds pass) every other one is stopped and the error quotes the log
    of the first to fail.
    """
    workdir = Path(workdir or tempfile.mkdtemp(prefix="placement-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = load_config(preset, list(overrides))
    metadata = read_metadata(data)
    config, _ = resolve_auto(config, metadata, hosts)
    features = [f for f in metadata.categorical if not f.multi_valued]
    servers = _start_servers(mode, config, features, hosts, workdir)
    children, outputs, logs, tees = [], [], [], []
    try:
        addresses = json.dumps([[server.address] for server in servers])
        coordinator = f"127.0.0.1:{_free_port()}"
        env = {
            **os.environ,
            "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
            "JAX_PLATFORMS": "cpu",
        }
        for process in range(hosts):
            outputs.append(workdir / f"record-{mode}-{process}.json")
            logs.append(workdir / f"trainer-{mode}-{process}.log")
            outputs[-1].unlink(missing_ok=True)
            command = [sys.executable, "-m", "hybridrec.cli.placement_run", "--mode", mode]
            command += ["--data", str(data), "--config", preset, "--servers", addresses]
            command += [arg for override in overrides for arg in ("--set", override)]
            command += ["--coordinator", coordinator, "--num-processes", str(hosts)]
            command += ["--process-id", str(process), "--out", str(outputs[-1])]
            command += ["--steps", str(steps)] if steps is not None else []
            command += ["--eval-batches", str(eval_batches)] if eval_batches is not None else []
            if process == 0:
                child = subprocess.Popen(
                    command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
                tees.append(_tee(child.stdout, logs[-1]))
            else:
                with open(logs[-1], "w") as log:
                    child = subprocess.Popen(command, env=env, stdout=log, stderr=log)
            children.append(child)
        failed = _wait_all(children, timeout)
        for tee in tees:
            tee.join(timeout=10)
        if failed is not None:
            process, code = failed
            tail = "".join(logs[process].read_text().splitlines(keepends=True)[-15:])
            raise UserError(
                f"placement run ({mode}): trainer process {process} failed ({code}); "
                f"log {logs[process]}:\n{tail}"
            )
        return [json.loads(path.read_text()) for path in outputs]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
        stop_servers(servers)


def _wait_all(children: Sequence[subprocess.Popen], timeout: float) -> tuple[int, Any] | None:
    """Waits for every child; the (index, exit code or "timeout") of the first to fail."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [child.poll() for child in children]
        failed = [(index, code) for index, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            return failed[0]
        if all(code == 0 for code in codes):
            return None
        if time.monotonic() > deadline:
            return next(i for i, code in enumerate(codes) if code is None), "timeout"
        time.sleep(0.1)


if __name__ == "__main__":
    main()
