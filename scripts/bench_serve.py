"""Serving benchmark: latency and throughput of `hybridrec serve`, parity, int8/fp16 quality.

1. A run of the quickstart preset on generated data (or `--run`), exported at fp32 and
   served by a real `hybridrec serve` process on a loopback port.
2. Parity: every eval row through the hashed-input path vs the per-row predictions of
   `evaluate` (`serving.reference.evaluate_rows`).
3. Closed-loop load, `--duration` seconds each, with 1, 8 and 32 clients sending
   single-row and 256-row requests of raw rows: p50/p99 latency, rows/s, errors. The
   load generator runs on the same machine and counts against it.
4. On the real Criteo sample (when present): the `criteo_dlrm` preset trained one epoch
   with embedding.capacity=300000, exported at fp32, fp16 and int8; eval AUC of each
   and the embedding bytes against fp32.

    python scripts/bench_serve.py [--duration 30] [--clients 1,8,32] [--rows 200000]

Last line: one JSON object (p99_ms_single_c8, rows_per_s_batch256_c8, errors,
parity_max_abs_diff, int8_auc_drop, int8_size_ratio, ...).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
CRITEO_SAMPLE = REPO_ROOT.parent / "shared" / "data" / "criteo_kaggle_sample" / "train.tsv.gz"
sys.path.insert(0, str(REPO_ROOT))  # the packages, also before `pip install -e .` lists serving
EIGHT_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


def hybridrec(*args: str, env: dict | None = None) -> str:
    """Runs the command line; exits with its output on failure."""
    result = subprocess.run(
        [sys.executable, "-m", "hybridrec", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
    )
    if result.returncode:
        sys.exit(
            f"hybridrec {' '.join(args)} failed:\n{result.stdout[-2000:]}{result.stderr[-4000:]}"
        )
    return result.stdout


def train_run(work: Path, raw: Path, preset: str, overrides: list[str]) -> Path:
    data, run = work / "data", work / "run"
    if not (run / "checkpoints" / "LAST").exists():
        print(f"== preprocess {raw} and train {preset}", flush=True)
        hybridrec("preprocess", "--input", str(raw), "--output", str(data), "--overwrite")
        sets = [item for key in overrides for item in ("--set", key)]
        hybridrec(
            "train", "--data", str(data), "--run-dir", str(run), "--config", preset,
            "--overwrite", *sets, env=EIGHT_DEVICES,
        )  # fmt: skip
    return run


class Server:
    """`hybridrec serve` on a free loopback port."""

    def __init__(self, export: Path, *extra: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hybridrec", "serve", str(export), "--port", "0", *extra],
            cwd=REPO_ROOT,
            env={key: value for key, value in os.environ.items() if key != "XLA_FLAGS"},
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.process.stdout.readline()
        if "http://" not in line:
            sys.exit(f"hybridrec serve did not start: {line}")
        address = line.split("http://", 1)[1].split()[0]
        self.host, self.port = address.rsplit(":", 1)
        self.model = json.loads(Path(export, "1", "manifest.json").read_text())["name"]

    def post(self, connection: http.client.HTTPConnection, body: bytes) -> tuple[int, bytes]:
        connection.request(
            "POST", f"/v2/models/{self.model}/infer", body, {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        return response.status, response.read()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def rows_body(lines: list[str]) -> bytes:
    tensor = {"name": "rows", "datatype": "BYTES", "shape": [len(lines)], "data": lines}
    return json.dumps({"inputs": [tensor]}).encode()


def parity(server: Server, run: Path) -> float:
    """Largest |served - evaluate| over the eval split (hashed-input path)."""
    from hybridrec.serving.reference import evaluate_rows

    ids, dense, _, expected = evaluate_rows(run)
    connection = http.client.HTTPConnection(server.host, int(server.port), timeout=60)
    served = []
    for start in range(0, len(ids), 256):
        chunk_ids, chunk_dense = ids[start : start + 256], dense[start : start + 256]
        body = {
            "inputs": [
                {"name": "ids", "datatype": "UINT64", "shape": list(chunk_ids.shape), "data": chunk_ids.ravel().tolist()},
                {"name": "dense", "datatype": "FP32", "shape": list(chunk_dense.shape), "data": chunk_dense.ravel().tolist()},
            ]
        }  # fmt: skip
        status, answer = server.post(connection, json.dumps(body).encode())
        assert status == 200, answer
        served += json.loads(answer)["outputs"][0]["data"]
    connection.close()
    return float(np.max(np.abs(np.asarray(served, np.float32) - expected)))


def load(server: Server, bodies: list[bytes], rows: int, clients: int, duration: float) -> dict:
    """Closed loop: `clients` threads each send a request as soon as the last answered."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors = [0] * clients
    start_barrier = threading.Barrier(clients + 1)
    deadline = [0.0]

    def client(index: int) -> None:
        connection = http.client.HTTPConnection(server.host, int(server.port), timeout=60)
        start_barrier.wait()
        position = index
        while time.perf_counter() < deadline[0]:
            began = time.perf_counter()
            try:
                status, _ = server.post(connection, bodies[position % len(bodies)])
            except (OSError, http.client.HTTPException):
                status = 0
                connection.close()
                connection = http.client.HTTPConnection(server.host, int(server.port), timeout=60)
            if status == 200:
                latencies[index].append(time.perf_counter() - began)
            else:
                errors[index] += 1
            position += clients
        connection.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    began = time.perf_counter()
    deadline[0] = began + duration
    start_barrier.wait()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    merged = np.concatenate([np.asarray(values) for values in latencies]) * 1e3
    return {
        "requests": int(len(merged)),
        "p50_ms": round(float(np.percentile(merged, 50)), 2) if len(merged) else None,
        "p99_ms": round(float(np.percentile(merged, 99)), 2) if len(merged) else None,
        "rows_per_s": round(len(merged) * rows / elapsed, 1),
        "errors": int(sum(errors)),
    }


def measure_serving(
    export: Path, run: Path, raw: Path, clients: list[int], duration: float
) -> dict:
    """Parity, then every load level, against one `hybridrec serve` process."""
    server = Server(export)
    result: dict = {}
    try:
        result["parity_max_abs_diff"] = parity(server, run)
        print(f"parity: max |served - evaluate| = {result['parity_max_abs_diff']:.2e}", flush=True)
        lines = [line for line in raw.read_text().split("\n")[:20000] if line]
        singles = [rows_body([line]) for line in lines[:4096]]
        batches = [rows_body(lines[i : i + 256]) for i in range(0, len(lines) - 256, 256)]
        errors = 0
        for count in clients:
            for kind, bodies, rows in (("single", singles, 1), ("batch256", batches, 256)):
                measured = load(server, bodies, rows, count, duration)
                errors += measured["errors"]
                print(f"{kind:>8} c{count:<3} {measured}", flush=True)
                for key, value in measured.items():
                    result[f"{key}_{kind}_c{count}"] = value
        result["errors"] = errors
    finally:
        server.stop()
    return result


def quality(work: Path, sample: Path, overrides: list[str]) -> dict:
    """AUC and embedding bytes of fp16 and int8 exports against fp32 on the Criteo sample."""
    import pyarrow.parquet as pq
    from hybridrec.model import StreamingMetrics
    from hybridrec.pipeline import read_metadata
    from hybridrec.serving import ServedModel, export_run

    run = train_run(work, sample, "criteo_dlrm", ["embedding.capacity=300000", *overrides])
    metadata = read_metadata(work / "data")
    table = pq.read_table(metadata.split_files("eval"))
    names = [feature.name for feature in metadata.categorical]
    ids = np.stack([table.column(n).to_numpy().astype(np.uint64) for n in names], axis=1)
    dense = np.stack([table.column(n).to_numpy() for n in metadata.dense_columns], axis=1)
    labels = table.column(metadata.label_column).to_numpy()
    results = {}
    for precision in ("fp32", "fp16", "int8"):
        summary = export_run(run, work / f"export_{precision}", precision=precision, quiet=True)
        model = ServedModel(summary["path"], max_batch=1024)
        probabilities, _ = model.predict(ids, dense.astype(np.float32))
        model.close()
        metrics = StreamingMetrics()
        metrics.update(probabilities, labels)
        results[precision] = {
            "auc": float(metrics.result()["auc"]),
            "embedding_bytes": summary["embedding_bytes"],
            "total_bytes": summary["total_bytes"],
        }
        print(f"  {precision}: {results[precision]}", flush=True)
    fp32 = results["fp32"]
    return {
        "criteo_eval_rows": int(len(labels)),
        "auc_fp32": round(fp32["auc"], 6),
        "int8_auc_drop": round(fp32["auc"] - results["int8"]["auc"], 7),
        "fp16_auc_drop": round(fp32["auc"] - results["fp16"]["auc"], 7),
        "int8_size_ratio": round(results["int8"]["embedding_bytes"] / fp32["embedding_bytes"], 4),
        "fp16_size_ratio": round(results["fp16"]["embedding_bytes"] / fp32["embedding_bytes"], 4),
        "int8_total_size_ratio": round(results["int8"]["total_bytes"] / fp32["total_bytes"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per load level")
    parser.add_argument("--clients", default="1,8,32", help="concurrent clients per level")
    parser.add_argument("--rows", type=int, default=200_000, help="generated rows to train on")
    parser.add_argument("--work", help="working directory (default: a temporary one; reused)")
    parser.add_argument("--criteo", default=str(CRITEO_SAMPLE), help="real Criteo sample")
    parser.add_argument("--skip-quality", action="store_true", help="no int8/fp16 quality run")
    parser.add_argument("--skip-load", action="store_true", help="no load run (quality only)")
    parser.add_argument(
        "--criteo-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more overrides of the criteo_dlrm run (e.g. data.batch_size=512)",
    )
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_serve_"))
    raw = work / "synthetic" / "raw.tsv"
    if not raw.exists():
        raw.parent.mkdir(parents=True, exist_ok=True)
        hybridrec("generate", "--output", str(raw), "--rows", str(args.rows), "--seed", "3")
    run = train_run(work / "synthetic", raw, "quickstart", [])
    export = work / "synthetic" / "export" / "ctr"
    if not export.exists():
        hybridrec("export", "--run", str(run), "--out", str(export))
    result: dict = {}
    if args.skip_load:
        print("load: skipped (--skip-load)", flush=True)
    else:
        clients = [int(count) for count in args.clients.split(",")]
        result.update(measure_serving(export, run, raw, clients, args.duration))
    if args.skip_quality or not Path(args.criteo).exists():
        print(f"quality: skipped ({args.criteo} absent or --skip-quality)", flush=True)
        result.update(int8_auc_drop=None, int8_size_ratio=None)
    else:
        print(f"== quality on {args.criteo}", flush=True)
        name = "criteo" + "".join(f"_{o.replace('=', '-')}" for o in args.criteo_set)
        result.update(quality(work / name, Path(args.criteo), args.criteo_set))
    keys = ["p99_ms_single_c8", "rows_per_s_batch256_c8", "errors", "parity_max_abs_diff",
            "int8_auc_drop", "int8_size_ratio"]  # fmt: skip
    print(json.dumps({**{key: result.get(key) for key in keys}, **result}))


if __name__ == "__main__":
    main()
