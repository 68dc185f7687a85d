"""Scaling of the embedding service: 1, 2, 4 shard server processes x 1, 2, 4 client processes.

For each number of servers S it starts S `hybridrec serve-embeddings` processes hosting
4 shards between them (so the table is the same; only the processes change), and for
each number of clients C runs C trainer-like client processes for --duration seconds.
A client loops: a batch of --batch samples x --features Zipf-skewed ids (one table,
dim --dim) -> dedupe -> lookup -> update (SGD, learning rate 1, zero init, gradient 1
per distinct id), so a row's value is minus the number of updates it took. Each client
draws --batch-pool batches before the clock starts and cycles through them. Measured
per (S, C):

- lookup+update rows/s (distinct rows looked up plus rows updated, over all clients),
  samples/s, and rows/s per CPU core the servers used (their utime+stime);
- p50/p99 of one batch's lookup+update round trip, seen by the clients;
- bytes on the wire per sample: the TCP payload of the servers' connections (`ss -ti`
  bytes_received + bytes_sent), over the samples of the run;
- lost updates: after the last client run of each S, every touched row is read back
  and compared with minus its update count (must be 0).

This machine's cores bound the totals (servers and clients share them), so the
per-core figures are the ones that carry to a cluster (docs/scale.md).

    python scripts/bench_scale.py                 # ~5 minutes: 9 runs of 12 s + start-up
    python scripts/bench_scale.py --duration 5 --servers 1 2 --clients 1 2

Last line: JSON {"rows_per_s": {"S servers": {"C clients": rows/s}},
"scaling_2_over_1_servers", "lost_updates", ...}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from hybridrec.common.progress import Progress
from hybridrec.embedding_store import (
    EmbeddingStore,
    InitializerConfig,
    SparseOptimizerConfig,
    TableConfig,
)
from hybridrec.embedding_store.remote.client import connect

from hybridrec.cli.server_processes import start_server_process, stop_servers

TABLE = "scale"
NUM_SHARDS = 4
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def table(args) -> TableConfig:
    return TableConfig(
        name=TABLE,
        dim=args.dim,
        capacity=args.capacity,
        initializer=InitializerConfig(kind="zeros"),
        optimizer=SparseOptimizerConfig(name="sgd", learning_rate=1.0),
    )


def write_tables(path: Path, args) -> None:
    path.write_text(
        f'[[tables]]\nname = "{TABLE}"\ndim = {args.dim}\ncapacity = {args.capacity}\n'
        '[tables.initializer]\nkind = "zeros"\n'
        '[tables.optimizer]\nname = "sgd"\nlearning_rate = 1.0\n'
    )


def ids_of(ranks: np.ndarray) -> np.ndarray:
    """Rank -> id spread over 64 bits (times an odd constant: a bijection). [n] uint64."""
    return ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)


def client(index: int, addresses: list[str], args, start_at: float, results, may_close) -> None:
    """One trainer-like client: lookup + update per batch until the deadline."""
    store = EmbeddingStore(
        [table(args)], shards=connect(addresses, [table(args)], token=None, retry_timeout=30)
    )
    rng = np.random.default_rng([index, int(start_at)])
    # Batches are drawn before the clock starts and cycled, so that the clients spend
    # their CPU on the requests (as a trainer's input pipeline runs ahead of the lookups).
    pool = []
    for _ in range(args.batch_pool):
        ranks = np.unique((rng.zipf(1.1, size=args.batch * args.features) - 1) % args.distinct)
        pool.append((ranks, ids_of(ranks), np.ones((len(ranks), args.dim), np.float32)))
    counts = np.zeros(args.distinct, np.int64)
    latencies, rows, samples = [], 0, 0
    time.sleep(max(0.0, start_at - time.time()))  # every client starts together
    deadline = start_at + args.duration
    cpu = time.process_time()
    while time.time() < deadline:
        ranks, ids, gradients = pool[len(latencies) % len(pool)]
        begin = time.perf_counter()
        store.lookup(TABLE, ids).result()
        store.apply_gradients(TABLE, ids, gradients).result()
        latencies.append(time.perf_counter() - begin)
        counts[ranks] += 1
        rows += 2 * len(ids)
        samples += args.batch
    results.put((index, counts, np.array(latencies), rows, samples, time.process_time() - cpu))
    may_close.wait()  # the parent reads the connections' byte counts first
    store.close()


def process_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def process_rss_bytes(pid: int) -> int:
    match = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(match.group(1)) * 1024 if match else 0


def wire_bytes(ports: list[int]) -> int:
    """TCP payload bytes in and out of the servers' established connections so far."""
    server_side = " or ".join(f"sport = :{port}" for port in ports)
    output = subprocess.run(
        ["ss", "-tinH", "state", "established", f"( {server_side} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    received = sum(int(n) for n in re.findall(r"bytes_received:(\d+)", output))
    sent = sum(int(n) for n in re.findall(r"bytes_sent:(\d+)", output))
    return received + sent


def run_clients(num_clients: int, servers, args, totals: np.ndarray) -> dict:
    """C client processes against the running servers; adds their updates to `totals`."""
    context = multiprocessing.get_context("spawn")
    results, may_close = context.Queue(), context.Event()
    addresses = [server.address for server in servers]
    start_at = time.time() + 5.0 + 2.0 * num_clients  # time to import and draw batches
    processes = [
        context.Process(target=client, args=(index, addresses, args, start_at, results, may_close))
        for index in range(num_clients)
    ]
    for process in processes:
        process.start()
    time.sleep(max(0.0, start_at - time.time()))
    cpu_before = sum(process_cpu_seconds(server.pid) for server in servers)
    outcomes = [results.get(timeout=args.duration + 300) for _ in processes]
    server_cpu = sum(process_cpu_seconds(server.pid) for server in servers) - cpu_before
    wire = wire_bytes([int(server.address.rsplit(":", 1)[1]) for server in servers])
    may_close.set()
    for process in processes:
        process.join()
    for _, counts, _, _, _, _ in outcomes:
        totals += counts
    latencies = np.concatenate([outcome[2] for outcome in outcomes])
    rows = sum(outcome[3] for outcome in outcomes)
    samples = sum(outcome[4] for outcome in outcomes)
    return {
        "rows_per_s": rows / args.duration,
        "samples_per_s": samples / args.duration,
        "p50_ms": float(np.percentile(latencies, 50) * 1e3),
        "p99_ms": float(np.percentile(latencies, 99) * 1e3),
        "server_cpu_s": server_cpu,
        "client_cpu_s": sum(outcome[5] for outcome in outcomes),
        "rows_per_server_core_s": rows / max(server_cpu, 1e-9),
        "wire_bytes_per_sample": wire / max(samples, 1),
        "wire_bytes_per_row": wire / max(rows, 1),
        "batches": int(len(latencies)),
    }


def lost_updates(servers, args, totals: np.ndarray) -> tuple[int, int]:
    """(rows whose value is not minus their update count, rows checked)."""
    tables = [table(args)]
    addresses = [server.address for server in servers]
    store = EmbeddingStore(tables, shards=connect(addresses, tables, token=None, retry_timeout=30))
    touched = np.flatnonzero(totals)
    lost = 0
    for part in np.array_split(touched, max(1, len(touched) // 200_000)):
        values = store.lookup(TABLE, ids_of(part), train=False).result()
        expected = -totals[part].astype(np.float32)[:, None]
        lost += int(np.count_nonzero(np.any(values != expected, axis=1)))
    store.close()
    return lost, len(touched)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--duration", type=float, default=12.0, help="seconds per run")
    parser.add_argument("--batch", type=int, default=2048, help="samples per batch")
    parser.add_argument("--features", type=int, default=26, help="ids per sample")
    parser.add_argument("--dim", type=int, default=16, help="embedding dimension")
    parser.add_argument("--distinct", type=int, default=2_000_000, help="id universe size")
    parser.add_argument("--capacity", type=int, default=4_000_000, help="table rows")
    parser.add_argument("--batch-pool", type=int, default=32, help="distinct batches per client")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    tables_file = workdir / "tables.toml"
    write_tables(tables_file, args)
    print(
        f"cores={os.cpu_count()} load average={os.getloadavg()} logs in {workdir}", file=sys.stderr
    )
    runs = len(args.servers) * len(args.clients)
    progress = Progress("bench-scale", total=runs, unit="runs", interval=0.0)
    table_rows: dict[str, dict[str, dict]] = {}
    lost_total, checked_total, memory = 0, 0, {}
    for num_servers in args.servers:
        servers = [
            start_server_process(
                tables_file,
                num_shards=NUM_SHARDS,
                shards=list(range(NUM_SHARDS))[index::num_servers],
                log_path=workdir / f"servers{num_servers}-{index}.log",
            )
            for index in range(num_servers)
        ]
        totals = np.zeros(args.distinct, np.int64)
        try:
            for num_clients in args.clients:
                result = run_clients(num_clients, servers, args, totals)
                table_rows.setdefault(f"{num_servers} servers", {})[f"{num_clients} clients"] = (
                    result
                )
                progress.update(
                    1, servers=num_servers, clients=num_clients,
                    rows_per_s=f"{result['rows_per_s'] / 1e6:.2f}M", p99_ms=f"{result['p99_ms']:.0f}",
                )  # fmt: skip
            lost, checked = lost_updates(servers, args, totals)
            lost_total += lost
            checked_total += checked
            rss = sum(process_rss_bytes(server.pid) for server in servers)
            memory[f"{num_servers} servers"] = {"rss_bytes": rss, "rows": checked}
        finally:
            stop_servers(servers)
    progress.close()

    print(
        f"{'':>10}" + "".join(f"{c:>26}" for c in table_rows[next(iter(table_rows))]),
        file=sys.stderr,
    )
    for servers_label, row in table_rows.items():
        cells = "".join(
            f"{r['rows_per_s'] / 1e6:7.2f}M p99 {r['p99_ms']:5.0f}ms {r['wire_bytes_per_sample']:5.0f} B/sample"
            for r in row.values()
        )
        print(f"{servers_label:>10}{cells}", file=sys.stderr)
    rates = {
        s: {c: round(r["rows_per_s"]) for c, r in row.items()} for s, row in table_rows.items()
    }

    def best(servers_label: str) -> float:
        return max(r["rows_per_s"] for r in table_rows[servers_label].values())

    scaling = (
        best("2 servers") / best("1 servers")
        if {"1 servers", "2 servers"} <= set(table_rows)
        else None
    )
    all_runs = [r for row in table_rows.values() for r in row.values()]
    summary = {
        "rows_per_s": rates,
        "scaling_2_over_1_servers": round(scaling, 3) if scaling else None,
        "lost_updates": lost_total,
        "rows_checked": checked_total,
        "p99_ms": {s: {c: round(r["p99_ms"], 1) for c, r in row.items()} for s, row in table_rows.items()},
        "rows_per_server_core_s": round(float(np.median([r["rows_per_server_core_s"] for r in all_runs]))),
        "wire_bytes_per_sample": round(float(np.median([r["wire_bytes_per_sample"] for r in all_runs])), 1),
        "wire_bytes_per_row": round(float(np.median([r["wire_bytes_per_row"] for r in all_runs])), 2),
        "server_memory": memory,
        "cores": os.cpu_count(),
        "duration_s": args.duration,
        "batch": args.batch,
        "features": args.features,
        "dim": args.dim,
        "runs": {s: row for s, row in table_rows.items()},
    }  # fmt: skip
    (workdir / "bench_scale.json").write_text(json.dumps(summary, indent=1))
    print(f"full results: {workdir / 'bench_scale.json'}", file=sys.stderr)
    summary.pop("runs")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
