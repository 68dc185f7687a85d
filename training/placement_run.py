"""One run of the DMT placement comparison: the trainer processes and their servers.

`launch` starts, per host, its embedding server(s) and then the trainer processes (one
per host, `python -m training.placement_run`, a multi-process JAX job), and returns
every process's record (`training.placement.train` and `evaluate`): flat data-parallel
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from common.errors import ConfigError, UserError
from embedding_store import EmbeddingStore
from embedding_store.processes import start_server_process, stop_servers
from embedding_store.remote import connect
from model import (
    create_train_state,
    make_eval_step,
    make_mesh,
    make_train_step,
    maybe_initialize_distributed,
)
from model import tower_parallel as tp
from model.config import MeshConfig
from pipeline import read_metadata
from training.defaults import resolve_auto
from training.input import ParquetReader
from training.job import load_config
from training.placement import (
    FlatLayout,
    TowerLayout,
    evaluate,
    tower_of_process,
    tower_table_plans,
    train,
)
from training.tables import plan_tables


def write_tables_file(path, tables: Sequence[Any]) -> None:
    """A `serve-embeddings --tables` file (JSON) holding exactly `tables`."""
    Path(path).write_text(json.dumps({"tables": [dataclasses.asdict(t) for t in tables]}))


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
    """One trainer process of a placement run (`python -m training.placement_run`).

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
    maybe_initialize_distributed(**(distributed or {}))
    process, processes = jax.process_index(), jax.process_count()
    config = load_config(preset, list(overrides))
    metadata = read_metadata(data)
    config, _ = resolve_auto(config, metadata, processes)
    features = [f for f in metadata.categorical if not f.multi_valued]
    if len(features) != len(metadata.categorical):
        raise ConfigError("the placement run reads single-valued features only")
    names = [f.name for f in features]
    batch_size = config.data.batch_size
    host = process * len(servers) // processes
    if mode == "towers":
        towers = tuple(tuple(tower) for tower in config.model.towers)
        if not towers:
            raise ConfigError("the tower-parallel layout needs model.towers")
        mesh = tp.make_tower_mesh(len(towers))
        tp.check_layout(mesh, towers, batch_size)
        layout = TowerLayout(mesh, names, towers, batch_size)
        if tower_of_process(process, processes, len(towers)) != layout.tower:
            raise ConfigError("this process's devices are not in its tower's group")
        if len(servers) % len(towers):
            raise ConfigError(f"{len(servers)} hosts do not split into {len(towers)} tower groups")
        per_tower = len(servers) // len(towers)
        addresses = [a for group in servers[layout.tower * per_tower :][:per_tower] for a in group]
        plan = tower_table_plans(config.embedding, features, towers)[layout.tower]
        train_step, eval_step = (
            tp.make_tower_parallel_train_step(mesh, towers),
            tp.make_tower_parallel_eval_step(mesh, towers),
        )
    else:
        mesh = make_mesh(MeshConfig(shape=(-1,), axis_names=("data",)))
        layout = FlatLayout(mesh, names, batch_size)
        addresses = [address for group in servers for address in group]
        plan = plan_tables(config.embedding, features)
        train_step, eval_step = make_train_step(mesh), make_eval_step(mesh)
    shards = connect(addresses, list(plan.tables), retry_timeout=60.0)
    store = EmbeddingStore(list(plan.tables), num_shards=len(shards), shards=shards)
    state = create_train_state(
        config.model,
        config.optimizer,
        mesh,
        config.seed,
        num_dense=len(metadata.dense_columns),
        num_features=len(names),
        embedding_dim=config.embedding.dim,
    )
    reader = ParquetReader.of_dataset(
        metadata,
        metadata.split_files(config.data.train_split),
        batch_size=batch_size,
        seed=config.seed,
        shuffle_buffer=config.data.shuffle_buffer,
    )
    steps = reader.batches_per_epoch if steps is None else steps
    state, record = train(
        reader.batches(steps),
        layout=layout,
        state=state,
        train_step=train_step,
        store=store,
        feature_tables=plan.feature_tables,
        local_servers=servers[host],
        group_servers=addresses if mode == "towers" else servers[host],
        steps=steps,
    )
    eval_reader = ParquetReader.of_dataset(
        metadata,
        metadata.split_files(config.data.eval_split),
        batch_size=batch_size,
        pad_final=True,
    )
    record["eval"] = evaluate(
        eval_reader.batches(eval_batches),
        layout=layout,
        state=state,
        eval_step=eval_step,
        store=store,
        feature_tables=plan.feature_tables,
    )
    store.close()
    record.update(
        mode=mode,
        process=process,
        host=host,
        tower=getattr(layout, "tower", None),
        batch_size=batch_size,
        steps=steps,
        dense_params=int(sum(leaf.size for leaf in jax.tree.leaves(state.params))),
    )
    return record


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m training.placement_run", description=run_process.__doc__.splitlines()[0]
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
    whose tables its tower group's servers hold (one shard per server).
    """
    workdir = Path(workdir or tempfile.mkdtemp(prefix="placement-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = load_config(preset, list(overrides))
    metadata = read_metadata(data)
    config, _ = resolve_auto(config, metadata, hosts)
    features = [f for f in metadata.categorical if not f.multi_valued]
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
        addresses = json.dumps([[server.address] for server in servers])
        coordinator = f"127.0.0.1:{_free_port()}"
        env = {
            **os.environ,
            "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
            "JAX_PLATFORMS": "cpu",
        }
        processes, outputs, logs = [], [], []
        for process in range(hosts):
            outputs.append(workdir / f"record-{mode}-{process}.json")
            logs.append(workdir / f"trainer-{mode}-{process}.log")
            command = [sys.executable, "-m", "training.placement_run", "--mode", mode]
            command += ["--data", str(data), "--config", preset, "--servers", addresses]
            command += [arg for override in overrides for arg in ("--set", override)]
            command += ["--coordinator", coordinator, "--num-processes", str(hosts)]
            command += ["--process-id", str(process), "--out", str(outputs[-1])]
            command += ["--steps", str(steps)] if steps is not None else []
            command += ["--eval-batches", str(eval_batches)] if eval_batches is not None else []
            with open(logs[-1], "w") as log:
                # process 0's progress lines go to this terminal, the others' to their logs
                stderr = None if process == 0 else subprocess.STDOUT
                processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=stderr))
        failed = []
        for process, child in enumerate(processes):
            try:
                code = child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = "timeout"
            if code != 0:
                failed.append((process, code))
        if failed:
            for child in processes:
                child.kill()
            process, code = failed[0]
            tail = "".join(logs[process].read_text().splitlines(keepends=True)[-15:])
            raise UserError(
                f"placement run ({mode}): trainer process {process} failed ({code}); "
                f"log {logs[process]}:\n{tail}"
            )
        return [json.loads(path.read_text()) for path in outputs]
    finally:
        stop_servers(servers)


if __name__ == "__main__":
    main()
