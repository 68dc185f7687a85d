"""`hybridrec serve-embeddings`: host embedding shards behind an Arrow Flight server.

Parses the flags, builds the table configs (from a tables file, or the tables
`hybridrec train` would build from a training preset and a dataset), runs an
`embedding_store.remote.shard_server.ShardServer` until SIGTERM/SIGINT, printing a stats line every
`--stats-interval` seconds, then drains in-flight updates and stops.

Example:
    hybridrec serve-embeddings --tables tables.toml --num-shards 4 --shards 0,1 --port 7001
    hybridrec serve-embeddings ... --tls-cert server.pem --tls-key server.key --tls-ca ca.pem
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import pyarrow.flight as flight

from hybridrec.cli import _flags
from hybridrec.cli._embedding_servers import read_token
from hybridrec.cli.server_processes import contiguous_shards
from hybridrec.common import config
from hybridrec.common.errors import UserError
from hybridrec.common.progress import Progress
from hybridrec.common.tls import TLSFiles
from hybridrec.embedding_store import TableConfig
from hybridrec.embedding_store.config import load_tables
from hybridrec.embedding_store.remote.client import ServerConnection, parse_addresses
from hybridrec.embedding_store.remote.shard_server import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_REQUEST_ROWS,
    ShardServer,
)
from hybridrec.embedding_store.remote.wire import TOKEN_ENV
from hybridrec.pipeline import read_dataset
from hybridrec.training.config import PRESET_DIR, TrainConfig
from hybridrec.training.tasks import task_of


def parse_shard_list(text: str, num_shards: int) -> list[int]:
    """ "0,1,5" or "0-3" or "0-3,8" -> sorted shard indices, each in [0, num_shards)."""
    indices: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        first, sep, last = part.partition("-")
        try:
            span = range(int(first), int(last) + 1) if sep else range(int(first), int(first) + 1)
        except ValueError:
            raise UserError(f"--shards: {part!r} is not an index or a range like 0-3") from None
        if not span:
            raise UserError(f"--shards: empty range {part!r}")
        indices.update(span)
    if not indices:
        raise UserError("--shards: no shard index given")
    bad = sorted(i for i in indices if not 0 <= i < num_shards)
    if bad:
        raise UserError(f"--shards: {bad} outside 0..{num_shards - 1} (--num-shards {num_shards})")
    return sorted(indices)


def _server_index(text: str) -> int:
    """An integer, or "auto": $HYBRIDREC_SERVER_INDEX, else the hostname's trailing ordinal
    (a Kubernetes StatefulSet pod is named <set>-<ordinal>)."""
    if text != "auto":
        try:
            return int(text)
        except ValueError:
            raise UserError(f"--server-index: {text!r} is not an integer or 'auto'") from None
    env = os.environ.get("HYBRIDREC_SERVER_INDEX", "")
    if env.isdigit():
        return int(env)
    hostname = socket.gethostname()
    ordinal = hostname.rsplit("-", 1)[-1]
    if not ordinal.isdigit():
        raise UserError(
            f"--server-index auto: $HYBRIDREC_SERVER_INDEX is unset and hostname {hostname!r} "
            "does not end in -<ordinal>"
        )
    return int(ordinal)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridrec serve-embeddings",
        description="Host embedding shards behind an Arrow Flight server.",
    )
    parser.add_argument(
        "--tables",
        help="table configs: a TOML or JSON file with a list of tables",
    )
    parser.add_argument(
        "--config",
        help="or: the training preset (with --data): the tables `hybridrec train` would build",
    )
    parser.add_argument("--data", help="with --config: preprocessed data dir (its feature spec)")
    _flags.add_override_flag(
        parser, "with --config: a training config override, e.g. embedding.dim=32"
    )
    parser.add_argument("--num-shards", type=int, help="total shards across all servers")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--shards", help='shard indices hosted here: "0,1" or "0-3"')
    which.add_argument(
        "--server-index",
        help='this server\'s index for a contiguous split ("auto": env or StatefulSet ordinal)',
    )
    parser.add_argument("--num-servers", type=int, help="servers sharing --num-shards")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (0.0.0.0 to accept remote clients)"
    )
    parser.add_argument("--port", type=int, default=0, help="port to bind (0: pick a free one)")
    parser.add_argument(
        "--token-file", help=f"file holding the shared secret (default: ${TOKEN_ENV}, else none)"
    )
    _flags.add_tls_flags(
        parser,
        cert_help="certificate chain (PEM): serve over TLS (grpc+tls://); with --check/--stats, "
        "the client certificate to present",
        ca_help="CA certificate (PEM): clients must present a certificate it signed (mutual "
        "TLS); with --check/--stats, the CA the server's certificate is checked against",
    )
    parser.add_argument(
        "--max-request-mb",
        type=float,
        default=DEFAULT_MAX_REQUEST_BYTES / 2**20,
        help="largest request body accepted, MiB",
    )
    parser.add_argument(
        "--max-request-rows",
        type=int,
        default=DEFAULT_MAX_REQUEST_ROWS,
        help="most ids in one request",
    )
    parser.add_argument(
        "--restore",
        metavar="URL",
        help="checkpoint URL to load the hosted shards from (latest step; none yet: start empty)",
    )
    parser.add_argument("--restore-step", type=int, help="restore this step instead of latest")
    parser.add_argument(
        "--ready-file", help="write {address, pid, shards} as JSON here once serving"
    )
    parser.add_argument(
        "--stats-interval", type=float, default=30.0, help="seconds between stats lines"
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="on SIGTERM, seconds to wait for in-flight updates before stopping",
    )
    parser.add_argument(
        "--check",
        metavar="ADDRESS",
        help="probe a running server (host:port): exit 0 if ready, 1 if not",
    )
    parser.add_argument(
        "--stats",
        metavar="ADDRESS",
        help="print a running server's stats as JSON (rows, latency p50/p99, pending updates)",
    )
    return parser


def _probe(address: str, token: str | None, tls: TLSFiles | None, action: str) -> int:
    """`--check` / `--stats`: one action against a running server, printed as JSON."""
    connection = ServerConnection(
        parse_addresses(address)[0], token=token, tls=tls, retry_timeout=0.0
    )
    try:
        result = connection.action(action, retry=False)
    except (flight.FlightError, UserError) as error:
        print(f"not ready: {str(error).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        connection.close()
    print(json.dumps(result, indent=None if action == "health" else 1))
    return 0 if action != "health" or result.get("ready") else 1


def main(argv: list[str]) -> int:
    """`hybridrec serve-embeddings`."""
    args = build_parser().parse_args(argv)
    token = read_token(args.token_file)
    tls = TLSFiles.from_flags(args)
    if args.check or args.stats:
        return _probe(args.check or args.stats, token, tls, "health" if args.check else "stats")
    if bool(args.tables) == bool(args.config) or not args.num_shards:
        raise UserError(
            "give --num-shards and one of --tables FILE or --config PRESET (or --check ADDRESS)"
        )
    if args.num_shards < 1:
        raise UserError(f"--num-shards must be >= 1, got {args.num_shards}")
    if tls is not None:
        tls.check_server()  # before the tables are built: a missing file is the first error
    if args.shards:
        indices = parse_shard_list(args.shards, args.num_shards)
    elif args.server_index is not None:
        if not args.num_servers:
            raise UserError("--server-index needs --num-servers")
        indices = contiguous_shards(
            _server_index(args.server_index), args.num_servers, args.num_shards
        )
    else:
        indices = list(range(args.num_shards))
    if args.tables:
        tables = load_tables(args.tables)
    else:
        tables = training_tables(args.config, args.data, args.overrides, args.num_shards)
    server = ShardServer(
        tables,
        indices,
        num_shards=args.num_shards,
        location=f"grpc://{args.host}:{args.port}",
        token=token,
        tls=tls,
        max_request_bytes=int(args.max_request_mb * 2**20),
        max_request_rows=args.max_request_rows,
        restore=args.restore,
        restore_step=args.restore_step,
    )
    return _serve(server, args)


def _serve(server: ShardServer, args: argparse.Namespace) -> int:
    stop = threading.Event()

    def request_stop(*_):
        stop.set()
        # A second signal during the drain (or while the interpreter exits, when Python
        # restores default handlers) must not kill the process half-way: ignore it.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, request_stop)
    # A wildcard bind is reachable on loopback; that is what local launchers connect to.
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    address = f"{host}:{server.port}"
    restored = (
        f", restored from step {server.restored_step}" if server.restored_step is not None else ""
    )
    if server.tls:
        security = "TLS" + (
            ", client certificates required" if server.client_certificates_required else ""
        )
    else:
        security = "plaintext"
    print(
        f"[serve-embeddings] serving shards {sorted(server.shards)} of {server.num_shards} "
        f"on {address}{restored}; token {'required' if server.token_required else 'off'}; "
        f"{security}",
        file=sys.stderr,
        flush=True,
    )
    for warning in _security_warnings(server, args):
        print(f"[serve-embeddings] warning: {warning}", file=sys.stderr, flush=True)
    if args.ready_file:
        ready = Path(args.ready_file)
        temporary = ready.with_name(ready.name + ".tmp")
        temporary.write_text(
            json.dumps({"address": address, "pid": os.getpid(), "shards": sorted(server.shards)})
        )
        temporary.replace(ready)  # atomic: a reader never sees half a file
    progress = Progress("serve-embeddings", unit="requests", interval=0.0)
    seen = 0
    while not stop.wait(args.stats_interval):
        try:
            stats = server.stats()
        except Exception as error:  # noqa: BLE001 - a stats line must never stop the server
            print(f"[serve-embeddings] stats unavailable: {error}", file=sys.stderr, flush=True)
            continue
        requests = sum(latency["count"] for latency in stats["latency"].values())
        progress.update(
            requests - seen,
            rows=stats["rows"],
            lookup_p99_ms=stats["latency"]["lookup"]["p99_ms"],
            apply_p99_ms=stats["latency"]["apply"]["p99_ms"],
            pending=stats["pending_updates"],
        )
        seen = requests
    print("[serve-embeddings] stopping: finishing in-flight updates", file=sys.stderr, flush=True)
    server.drain_and_stop(args.drain_timeout)
    stats = server.stats()
    progress.count = sum(latency["count"] for latency in stats["latency"].values())
    progress.close(rows=stats["rows"], rejected=stats["counters"].get("rejected", 0))
    return 0


def _security_warnings(server: ShardServer, args: argparse.Namespace) -> list[str]:
    """A private key other users can read; a token sent in plaintext beyond loopback."""
    warnings = []
    tls = TLSFiles.from_flags(args)
    if tls is not None and (line := tls.warn_readable_key()):
        warnings.append(line)
    if args.host in ("127.0.0.1", "localhost", "::1"):
        return warnings
    if server.token_required and not server.tls:
        warnings.append("the token crosses the network in plaintext: add --tls-cert and --tls-key")
    return warnings


def training_tables(
    preset: str, data: str | None, overrides: Sequence[str], num_shards: int | None = None
) -> list[TableConfig]:
    """The TableConfigs `hybridrec train --config preset --data data` builds, in its order
    (see `training.tables.resolve_tables`), over `num_shards` shards in all."""
    overrides = _flags.with_data(data, list(overrides))  # as `hybridrec train`
    train_config = config.load(TrainConfig, preset, overrides, preset_dir=PRESET_DIR)
    if not train_config.data.path:
        raise UserError("--config needs --data (or data.path in the preset): it names the tables")
    metadata = read_dataset(train_config.data.path)
    task = task_of(metadata)
    train_config, _ = task.resolve(train_config, metadata, 1)  # as `train` resolves it
    plan, plan_lines = task.tables(train_config, metadata, num_shards)
    for line in plan_lines:
        print(f"[serve-embeddings] {line}", file=sys.stderr, flush=True)
    return list(plan.tables)
