"""Load test and benchmark of remote embedding shards on loopback.

In one run:
  1. starts 2 `serve-embeddings` processes (one shard each);
  2. lookup throughput of the same Zipf-skewed batches through the remote store and
     through an in-process store with the same shards (rows/s, ratio); with --tls also
     through 2 more servers over mutual TLS with a token (a throwaway CA), the three
     stores then measured in 5 alternating turns each, and the p50 latency of small
     lookups (1024 ids) over plaintext and over TLS;
  3. load: 4 client processes for --duration seconds, each looping lookup + update
     (SGD, learning rate 1, zero init, gradient 1 per distinct id per batch), so a
     row's final value is minus the number of updates it took;
  4. lost updates: the per-row update counts the clients report are applied to an
     in-process reference store, and every touched row is compared with the remote one;
  5. wire dtypes (on the shared Criteo sample, or --input files): the `criteo_dlrm` preset
     trained for one epoch against 2 fresh servers per `embedding.wire_dtype`
     (synchronous, so the runs differ only by the wire dtype); wire bytes per training
     sample (lookups and updates: Arrow buffers, headers and table names as the servers
     count them, without gRPC framing) and the eval AUC, against float32, for every
     --wire-seeds seed (AUC deltas taken per seed, then averaged);
  6. load balance (--balance-steps > 0): a skewed workload (Zipf ids; a 16-wide table with
     many distinct rows per batch, a 64-wide one with a few hundred, a 512-wide one with 4)
     through 4 servers of one shard each, with whole rows and with the column split
     `plan_column_shards` picks from the first batches; per-server payload bytes (the
     servers' counters) and busiest/mean, and seconds per step.

Last line: JSON {"remote_over_local", "lost_updates", "p99_ms", ..., "bfloat16_wire_bytes_ratio",
"bfloat16_auc_delta", "float16_wire_bytes_ratio", "float16_auc_delta", ...,
"balance_busiest_over_mean_whole", "balance_busiest_over_mean_planned", ...}; with --tls
also "remote_over_local_tls", "tls_over_plaintext", "remote_lookup_rows_per_s_tls",
"small_lookup_p50_ms", "small_lookup_p50_ms_tls".

    python scripts/bench_remote.py --duration 120
    python scripts/bench_remote.py --tls                # and the TLS rows of phase 2
    python scripts/bench_remote.py --skip-load          # only phases 5 and 6
    python scripts/bench_remote.py --skip-load --wire-dtypes --balance-steps 200   # only 6
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_criteo import REPO, SAMPLE, _dataset, checked_inputs
from hybridrec.common.progress import Progress
from hybridrec.common.tls import TLSFiles
from hybridrec.embedding_store import (
    EmbeddingStore,
    InitializerConfig,
    SparseOptimizerConfig,
    TableConfig,
)
from hybridrec.embedding_store.columns import describe_plan, plan_column_shards
from hybridrec.embedding_store.remote.client import ServerConnection, connect

from hybridrec.cli.server_processes import start_server_process, start_servers, stop_servers

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


def _lookup_rows(store, batches, seconds: float) -> tuple[int, float]:
    """(rows, seconds) of `store.lookup` over `batches`, cycling for about `seconds`."""
    rows, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for ids in batches:
            store.lookup(TABLE, ids).result()
            rows += len(ids)
    return rows, time.perf_counter() - start


def _lookup_throughput(store, batches, seconds: float) -> float:
    """Rows/s of `store.lookup` over `batches`, cycling for about `seconds`."""
    rows, elapsed = _lookup_rows(store, batches, seconds)
    return rows / elapsed


def _small_lookup_p50_ms(store, rng, args, requests: int = 300) -> float:
    """Median milliseconds of one lookup of 1024 Zipf ids (per-request cost, not bandwidth)."""
    batches = [_ids(_ranks(rng, 1024, args.distinct)) for _ in range(16)]
    seconds = []
    for index in range(requests):
        start = time.perf_counter()
        store.lookup(TABLE, batches[index % len(batches)]).result()
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds) * 1e3)


TLS_TOKEN = "bench-remote-token"


def _tls_servers(tables_file: Path, workdir: Path) -> tuple[list, TLSFiles]:
    """2 servers (one shard each) requiring TLS, client certificates and a token."""
    from make_certs import issue, new_ca  # scripts/make_certs.py (needs cryptography)

    pki = workdir / "tls"
    ca = new_ca()
    ca_path, _ = ca.write(pki, "ca")
    cert, key = issue(ca, "localhost", hosts=["localhost", "127.0.0.1"]).write(pki, "server")
    client_cert, client_key = issue(ca, "bench client", client=True).write(pki, "client")
    flags = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca_path)]
    servers = [
        start_server_process(
            tables_file,
            num_shards=2,
            shards=[index],
            token=TLS_TOKEN,
            log_path=workdir / f"server{index}-tls.log",
            extra_args=["--stats-interval", "30", *flags],
        )
        for index in range(2)
    ]
    client = TLSFiles(ca=str(ca_path), cert=str(client_cert), key=str(client_key))
    return servers, client


WIRE_TARGET = {"bytes_ratio": 0.55, "auc_delta": 0.001}


def _train_over_wire(data: Path, wire_dtype: str, batch: int, workdir: Path, seed: int) -> dict:
    """One epoch of criteo_dlrm against 2 fresh servers; AUC and wire bytes per sample."""
    servers = start_servers(
        2, num_shards=2, config="criteo_dlrm", data=data, log_dir=workdir / f"servers-{wire_dtype}"
    )
    try:
        addresses = json.dumps([server.address for server in servers])
        run_dir = workdir / f"run-{wire_dtype}-seed{seed}"
        command = [sys.executable, "-m", "hybridrec", "train", "--config", "criteo_dlrm"]
        command += ["--data", str(data), "--run-dir", str(run_dir), "--quiet"]
        settings = [
            f"embedding.servers={addresses}",
            f"embedding.wire_dtype={wire_dtype}",
            f"data.batch_size={batch}",
            "hybrid.staleness=0",
            "log.tensorboard=false",
            f"seed={seed}",
        ]
        for setting in settings:
            command += ["--set", setting]
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)
        start = time.perf_counter()
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        if result.returncode:
            sys.stderr.write(result.stdout[-3000:] + result.stderr[-3000:])
            raise SystemExit(f"bench_remote: training with wire dtype {wire_dtype} failed")
        summary = json.loads((run_dir / "summary.json").read_text())
        counters = {}
        for server in servers:
            connection = ServerConnection(f"grpc://{server.address}")
            for key, value in connection.action("stats")["counters"].items():
                counters[key] = counters.get(key, 0) + value
            connection.close()
    finally:
        stop_servers(servers)
    train_bytes = counters.get("wire_bytes_lookup", 0) + counters.get("wire_bytes_apply", 0)
    out = {
        "auc": summary["eval"]["auc"],
        "samples": summary["samples"],
        "bytes_per_sample": train_bytes / summary["samples"],
        "lookup_bytes_per_sample": counters.get("wire_bytes_lookup", 0) / summary["samples"],
        "apply_bytes_per_sample": counters.get("wire_bytes_apply", 0) / summary["samples"],
        "eval_bytes_per_row": counters.get("wire_bytes_eval_lookup", 0)
        / max(1, summary["eval"]["count"]),
        "seconds": time.perf_counter() - start,
    }
    print(
        f"wire {wire_dtype}, seed {seed}: AUC {out['auc']:.5f}, {out['bytes_per_sample']:.1f} bytes per "
        f"training sample (lookup {out['lookup_bytes_per_sample']:.1f}, update "
        f"{out['apply_bytes_per_sample']:.1f}), eval {out['eval_bytes_per_row']:.1f} bytes per "
        f"row, {out['seconds']:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    return out


BALANCE_TABLES = (("items", 16, 10**6, 1.1), ("category", 64, 300, 1.3), ("device", 512, 4, 1.5))


def _balance_batches(steps: int, batch: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Per step {table: ids [batch]}: Zipf ranks over each table's ids."""
    rng = np.random.default_rng(seed)
    return [
        {
            name: _ids((rng.zipf(skew, size=batch) - 1) % distinct)
            for name, _, distinct, skew in BALANCE_TABLES
        }
        for _ in range(steps)
    ]


def _balance_run(tables, batches, workdir: Path, label: str) -> dict:
    """Steps of pooled lookups + updates through 4 servers; per-server bytes and step time."""
    path = workdir / f"balance-{label}.toml"
    path.write_text(
        "".join(
            f'[[tables]]\nname = "{t.name}"\ndim = {t.dim}\ncapacity = {t.capacity}\n'
            f"column_shards = {t.column_shards}\n"
            for t in tables
        )
    )
    servers = start_servers(4, num_shards=4, tables=path, log_dir=workdir / f"balance-{label}")
    try:
        shards = connect([server.address for server in servers], tables)
        feature_tables = {t.name: t.name for t in tables}
        with EmbeddingStore(tables, num_shards=4, shards=shards) as store:
            start = time.perf_counter()
            for features in batches:
                lookups = [
                    store.lookup_features({n: features[n]}, feature_tables={n: n}).result()
                    for n in feature_tables
                ]
                for lookup in lookups:
                    grads = np.full(lookup.embeddings.shape, 1e-3, np.float32)
                    store.apply_pooled_gradients(lookup, grads).result()
            seconds = (time.perf_counter() - start) / len(batches)
        loads = []
        for server in servers:
            connection = ServerConnection(f"grpc://{server.address}")
            counters = connection.action("stats")["counters"]
            connection.close()
            loads.append(counters.get("wire_bytes_lookup", 0) + counters.get("wire_bytes_apply", 0))
    finally:
        stop_servers(servers)
    loads = np.array(loads, np.float64)
    print(
        f"balance {label}: bytes per server {[f'{x / 2**20:.1f} MiB' for x in loads]}, "
        f"busiest/mean {loads.max() / loads.mean():.3f}, {seconds * 1e3:.1f} ms per step",
        file=sys.stderr,
        flush=True,
    )
    return {"busiest_over_mean": loads.max() / loads.mean(), "seconds_per_step": seconds}


def _balance(args) -> dict:
    """Phase 6: per-server load of a skewed workload with whole rows and with the plan."""
    tables = [
        TableConfig(name=name, dim=dim, capacity=max(1024, 2 * distinct))
        for name, dim, distinct, _ in BALANCE_TABLES
    ]
    batches = _balance_batches(args.balance_steps, args.balance_batch)
    sample = {t.name: [batch[t.name] for batch in batches[:20]] for t in tables}
    plan = plan_column_shards(tables, sample, num_shards=4)
    print(describe_plan(tables, plan, sample, 4), file=sys.stderr, flush=True)
    planned = [dataclasses.replace(t, column_shards=plan[t.name]) for t in tables]
    workdir = Path(tempfile.mkdtemp(prefix="bench-remote-balance-"))
    whole = _balance_run(tables, batches, workdir, "whole-rows")
    split = _balance_run(planned, batches, workdir, "planned")
    return {
        "balance_busiest_over_mean_whole": round(whole["busiest_over_mean"], 4),
        "balance_busiest_over_mean_planned": round(split["busiest_over_mean"], 4),
        "balance_ms_per_step_whole": round(whole["seconds_per_step"] * 1e3, 2),
        "balance_ms_per_step_planned": round(split["seconds_per_step"] * 1e3, 2),
        "balance_plan": plan,
    }


def _wire_dtypes(args) -> dict:
    """Phase 5: bytes per sample and AUC per wire dtype, against float32."""
    if not args.input and not SAMPLE.exists():
        print(f"wire dtypes skipped: {SAMPLE} is absent (pass --input)", file=sys.stderr)
        return {}
    inputs = checked_inputs(args.input)
    data = _dataset(inputs, args.cache)
    workdir = Path(tempfile.mkdtemp(prefix="bench-remote-wire-"))
    per_seed = [
        {
            dtype: _train_over_wire(data, dtype, args.batch, workdir, seed)
            for dtype in args.wire_dtypes
        }
        for seed in args.wire_seeds
    ]
    # Means over the seeds; the AUC deltas are taken per seed, then averaged.
    runs = {
        dtype: {
            key: float(np.mean([seed_runs[dtype][key] for seed_runs in per_seed]))
            for key in ("auc", "bytes_per_sample")
        }
        for dtype in args.wire_dtypes
    }
    base = runs.get("float32")
    out = {f"{d}_wire_bytes_per_sample": round(r["bytes_per_sample"], 1) for d, r in runs.items()}
    out.update({f"{d}_auc": round(r["auc"], 5) for d, r in runs.items()})
    if base:
        for dtype, run in runs.items():
            if dtype == "float32":
                continue
            ratio = run["bytes_per_sample"] / base["bytes_per_sample"]
            delta = run["auc"] - base["auc"]
            out[f"{dtype}_wire_bytes_ratio"] = round(ratio, 4)
            out[f"{dtype}_auc_delta"] = round(delta, 5)
            out[f"{dtype}_auc_deltas_per_seed"] = [
                round(r[dtype]["auc"] - r["float32"]["auc"], 5) for r in per_seed
            ]
            out[f"{dtype}_targets_met"] = bool(
                ratio <= WIRE_TARGET["bytes_ratio"] and abs(delta) <= WIRE_TARGET["auc_delta"]
            )
    print("\n| wire dtype | bytes/sample | x float32 | AUC | delta |", file=sys.stderr)
    print("|---|---|---|---|---|", file=sys.stderr)
    for dtype, run in runs.items():
        ratio = run["bytes_per_sample"] / base["bytes_per_sample"] if base else float("nan")
        delta = run["auc"] - base["auc"] if base else float("nan")
        print(
            f"| {dtype} | {run['bytes_per_sample']:.1f} | {ratio:.3f} | {run['auc']:.5f} | "
            f"{delta:+.5f} |",
            file=sys.stderr,
        )
    out["wire_batch"] = args.batch
    out["wire_seeds"] = args.wire_seeds
    return out


def _interleaved_throughput(stores: dict, batches, seconds: float, rounds: int = 5) -> dict:
    """Rows/s of each store's lookups, measured in `rounds` alternating turns of
    seconds / rounds each, so a drift of the machine's speed touches every store alike."""
    rows = dict.fromkeys(stores, 0)
    spent = dict.fromkeys(stores, 0.0)
    for _ in range(rounds):
        for name, store in stores.items():
            done, elapsed = _lookup_rows(store, batches, seconds / rounds)
            rows[name] += done
            spent[name] += elapsed
    return {name: rows[name] / spent[name] for name in stores}


def _compare_with_tls(
    args, tables, tables_file, workdir, batches, local, remote
) -> tuple[dict, dict]:
    """Phase 2 with --tls: in-process, plaintext and mutual-TLS stores in alternating turns
    (lookup rows/s of the same batches), then the 1024-id lookup p50 of both remote ones.

    Returns:
        ({"local", "remote", "tls"}: rows/s, the summary's TLS keys).
    """
    servers, client_tls = _tls_servers(tables_file, workdir)
    try:
        addresses = [server.address for server in servers]
        secure = EmbeddingStore(
            tables,
            num_shards=2,
            shards=connect(addresses, tables, token=TLS_TOKEN, tls=client_tls, retry_timeout=60),
        )
        for ids in batches:
            secure.lookup(TABLE, ids).result()
        stores = {"local": local, "remote": remote, "tls": secure}
        rates = _interleaved_throughput(stores, batches, args.compare_seconds)
        plain_small = _small_lookup_p50_ms(remote, np.random.default_rng(1), args)
        tls_small = _small_lookup_p50_ms(secure, np.random.default_rng(1), args)
        secure.close()
    finally:
        for server in servers:
            server.stop()
    print(
        f"lookup rows/s over mutual TLS: {rates['tls'] / 1e6:.2f} M "
        f"({rates['tls'] / rates['local']:.3f} of in-process, {rates['tls'] / rates['remote']:.3f} "
        f"of plaintext); 1024-id lookup p50 {plain_small:.2f} ms plaintext, {tls_small:.2f} ms TLS",
        file=sys.stderr,
    )
    return rates, {
        "remote_over_local_tls": round(rates["tls"] / rates["local"], 3),
        "tls_over_plaintext": round(rates["tls"] / rates["remote"], 3),
        "remote_lookup_rows_per_s_tls": round(rates["tls"]),
        "small_lookup_p50_ms": round(plain_small, 3),
        "small_lookup_p50_ms_tls": round(tls_small, 3),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=120.0, help="load phase, seconds")
    parser.add_argument("--clients", type=int, default=4, help="load client processes")
    parser.add_argument("--batch-ids", type=int, default=4096 * 26, help="ids per batch")
    parser.add_argument("--distinct", type=int, default=2_000_000, help="id universe size")
    parser.add_argument("--capacity", type=int, default=8_000_000, help="table rows")
    parser.add_argument("--compare-seconds", type=float, default=15.0, help="per store")
    parser.add_argument("--skip-load", action="store_true", help="only the wire-dtype phase")
    parser.add_argument(
        "--tls",
        action="store_true",
        help="phase 2 also over mutual TLS with a token (2 more servers, a throwaway CA)",
    )
    parser.add_argument(
        "--wire-dtypes",
        nargs="*",
        default=["float32", "bfloat16", "float16"],
        choices=["float32", "bfloat16", "float16"],
        help="wire dtypes to train with (none: skip)",
    )
    parser.add_argument("--input", nargs="+", type=Path, help="Criteo-format files (phase 5)")
    parser.add_argument("--cache", type=Path, default=REPO / "runs" / "bench_criteo")
    parser.add_argument("--batch", type=int, default=1024, help="phase 5 global batch size")
    parser.add_argument(
        "--wire-seeds", type=int, nargs="+", default=[0], help="phase 5 seeds (AUC: their mean)"
    )
    parser.add_argument("--balance-steps", type=int, default=200, help="phase 6 (0: skip)")
    parser.add_argument("--balance-batch", type=int, default=1024, help="phase 6 ids per table")
    args = parser.parse_args(argv)
    if args.skip_load:
        summary = _wire_dtypes(args) if args.wire_dtypes else {}
        summary.update(_balance(args) if args.balance_steps else {})
        print(json.dumps(summary))
        return 0

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
        tls_summary = {}
        if args.tls:  # the three stores in alternating turns
            rates, tls_summary = _compare_with_tls(
                args, tables, tables_file, workdir, batches, local, remote
            )
            local_rate, remote_rate = rates["local"], rates["remote"]
        else:
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
        **tls_summary,
    }
    print(
        f"load: {args.clients} clients x {args.duration:g} s, {rows / elapsed / 1e6:.2f} M rows/s, "
        f"lookup p50 {summary['p50_ms']} ms p99 {summary['p99_ms']} ms, apply p50 "
        f"{summary['apply_p50_ms']} ms p99 {summary['apply_p99_ms']} ms; "
        f"{len(touched)} rows checked, {lost} lost",
        file=sys.stderr,
    )
    summary.update(_wire_dtypes(args) if args.wire_dtypes else {})
    summary.update(_balance(args) if args.balance_steps else {})
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
