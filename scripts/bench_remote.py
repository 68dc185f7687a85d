"""Load test and benchmark of remote embedding shards on loopback.

In one run:
  1. starts 2 `serve-embeddings` processes (one shard each);
  2. lookup throughput of the same Zipf-skewed batches through the remote store and
     through an in-process store with the same shards (rows/s, ratio);
  3. load: 4 client processes for --duration seconds, each looping lookup + update
     (SGD, learning rate 1, zero init, gradient 1 per distinct id per batch), so a
     row's final value is minus the number of updates it took;
  4. lost updates: the per-row update counts the clients report are applied to an
     in-process reference store, and every touched row is compared with the remote one.

Last line: JSON {"remote_over_local", "lost_updates", "p99_ms", ...}.

    python scripts/bench_remote.py --duration 120
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common.progress import Progress
from embedding_store import EmbeddingStore, InitializerConfig, SparseOptimizerConfig, TableConfig
from embedding_store.processes import start_server_process
from embedding_store.remote import connect

TABLE = "bench"
DIM = 16


def _tables(capacity: int) -> list[TableConfig]:
    return [
        TableConfig(
            name=TABLE,
            dim=DIM,
            capacity=capacity,
            initializer=InitializerConfig(kind="zeros"),
            optimizer=SparseOptimizerConfig(name="sgd", learning_rate=1.0),
        )
    ]


def _write_tables(path: Path, capacity: int) -> None:
    path.write_text(
        "[[tables]]\n"
        f'name = "{TABLE}"\ndim = {DIM}\ncapacity = {capacity}\n'
        '[tables.initializer]\nkind = "zeros"\n'
        '[tables.optimizer]\nname = "sgd"\nlearning_rate = 1.0\n'
    )


def _ranks(rng: np.random.Generator, batch_ids: int, distinct: int) -> np.ndarray:
    """Zipf-skewed id ranks in [0, distinct): [batch_ids] int64."""
    return (rng.zipf(1.1, size=batch_ids) - 1) % distinct


def _ids(ranks: np.ndarray) -> np.ndarray:
    """Rank -> id, spread over 64 bits (times an odd constant: a bijection)."""
    return ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)


def _client(index, addresses, args, queue) -> None:
    """One load client: lookup + update loop; reports latencies and per-rank update counts."""
    tables = _tables(args.capacity)
    store = EmbeddingStore(
        tables, num_shards=2, shards=connect(addresses, tables, token=None, retry_timeout=60.0)
    )
    rng = np.random.default_rng(1000 + index)
    counts = np.zeros(args.distinct, np.int64)
    lookup_ms, apply_ms = [], []
    rows = 0
    deadline = time.monotonic() + args.duration
    while time.monotonic() < deadline:
        ranks = np.unique(_ranks(rng, args.batch_ids, args.distinct))
        ids = _ids(ranks)
        start = time.perf_counter()
        store.lookup(TABLE, ids).result()
        lookup_ms.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        store.apply_gradients(TABLE, ids, np.ones((len(ids), DIM), np.float32)).result()
        apply_ms.append((time.perf_counter() - start) * 1e3)
        counts[ranks] += 1  # ranks are unique within a batch
        rows += 2 * len(ids)
    store.flush()
    store.close()
    queue.put((index, counts, np.array(lookup_ms), np.array(apply_ms), rows))


def _lookup_throughput(store, batches, seconds: float) -> float:
    """Rows/s of `store.lookup` over `batches`, cycling for about `seconds`."""
    rows, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for ids in batches:
            store.lookup(TABLE, ids).result()
            rows += len(ids)
    return rows / (time.perf_counter() - start)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=120.0, help="load phase, seconds")
    parser.add_argument("--clients", type=int, default=4, help="load client processes")
    parser.add_argument("--batch-ids", type=int, default=4096 * 26, help="ids per batch")
    parser.add_argument("--distinct", type=int, default=2_000_000, help="id universe size")
    parser.add_argument("--capacity", type=int, default=8_000_000, help="table rows")
    parser.add_argument("--compare-seconds", type=float, default=15.0, help="per store")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    tables_file = workdir / "tables.toml"
    _write_tables(tables_file, args.capacity)
    tables = _tables(args.capacity)
    servers = [
        start_server_process(
            tables_file,
            num_shards=2,
            shards=[index],
            log_path=workdir / f"server{index}.log",
            extra_args=["--stats-interval", "30"],
        )
        for index in range(2)
    ]
    addresses = [server.address for server in servers]
    print(f"servers: {addresses} (logs in {workdir})", file=sys.stderr)
    try:
        # Same batches through both stores; warm both so every id has a row.
        rng = np.random.default_rng(0)
        batches = [_ids(_ranks(rng, args.batch_ids, args.distinct)) for _ in range(8)]
        local = EmbeddingStore(tables, num_shards=2)
        remote = EmbeddingStore(
            tables, num_shards=2, shards=connect(addresses, tables, token=None, retry_timeout=60.0)
        )
        for store in (local, remote):
            for ids in batches:
                store.lookup(TABLE, ids).result()
        local_rate = _lookup_throughput(local, batches, args.compare_seconds)
        remote_rate = _lookup_throughput(remote, batches, args.compare_seconds)
        local.close()
        print(
            f"lookup rows/s: in-process {local_rate / 1e6:.2f} M, remote {remote_rate / 1e6:.2f} M",
            file=sys.stderr,
        )

        # Load: clients in their own processes, all against the same two servers.
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        clients = [
            context.Process(target=_client, args=(index, addresses, args, queue))
            for index in range(args.clients)
        ]
        for client in clients:
            client.start()
        progress = Progress("bench-remote load", total=int(args.duration), unit="s")
        start = time.monotonic()
        while time.monotonic() - start < args.duration:
            time.sleep(min(5.0, max(0.1, args.duration - (time.monotonic() - start))))
            progress.update(int(time.monotonic() - start) - progress.count)
        results = [queue.get(timeout=args.duration + 300) for _ in clients]
        for client in clients:
            client.join()
        elapsed = time.monotonic() - start
        progress.close()
        counts = sum(result[1] for result in results)
        lookup_ms = np.concatenate([result[2] for result in results])
        apply_ms = np.concatenate([result[3] for result in results])
        rows = sum(result[4] for result in results)

        # Reference: the same per-row update totals through an in-process store.
        touched = np.flatnonzero(counts)
        touched_ids = _ids(touched)
        reference = EmbeddingStore(tables, num_shards=1)
        grads = np.repeat(counts[touched].astype(np.float32)[:, None], DIM, axis=1)
        reference.apply_gradients(TABLE, touched_ids, grads).result()
        expected = reference.lookup(TABLE, touched_ids, train=False).result()
        actual = remote.lookup(TABLE, touched_ids, train=False).result()
        lost = int(np.count_nonzero(np.any(actual != expected, axis=1)))
        reference.close()
        for shard in remote._shards:
            stats = shard.server_stats()
            latency = stats["latency"]
            print(
                f"server {shard.address}: {stats['rows']} rows, lookup p50/p99 "
                f"{latency['lookup']['p50_ms']:.1f}/{latency['lookup']['p99_ms']:.1f} ms, apply "
                f"p50/p99 {latency['apply']['p50_ms']:.1f}/{latency['apply']['p99_ms']:.1f} ms "
                f"(last {min(latency['lookup']['count'], 8192)} requests), "
                f"pending updates {stats['pending_updates']}, "
                f"rejected {stats['counters'].get('rejected', 0)}",
                file=sys.stderr,
            )
        remote.close()
    finally:
        for server in servers:
            server.stop()

    summary = {
        "remote_over_local": round(remote_rate / local_rate, 3),
        "lost_updates": lost,
        "p99_ms": round(float(np.percentile(lookup_ms, 99)), 2),
        "p50_ms": round(float(np.percentile(lookup_ms, 50)), 2),
        "apply_p50_ms": round(float(np.percentile(apply_ms, 50)), 2),
        "apply_p99_ms": round(float(np.percentile(apply_ms, 99)), 2),
        "load_rows_per_s": round(rows / elapsed),
        "local_lookup_rows_per_s": round(local_rate),
        "remote_lookup_rows_per_s": round(remote_rate),
        "rows_checked": len(touched),
        "updates_applied": int(counts.sum()),
        "clients": args.clients,
        "duration_s": args.duration,
    }
    print(
        f"load: {args.clients} clients x {args.duration:g} s, {rows / elapsed / 1e6:.2f} M rows/s, "
        f"lookup p50 {summary['p50_ms']} ms p99 {summary['p99_ms']} ms, apply p50 "
        f"{summary['apply_p50_ms']} ms p99 {summary['apply_p99_ms']} ms; "
        f"{len(touched)} rows checked, {lost} lost",
        file=sys.stderr,
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
