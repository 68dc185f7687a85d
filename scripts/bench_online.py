"""Online training end to end: files dropped into a folder -> a served model that trained on them.

Runs `hybridrec preprocess --follow`, `hybridrec train --follow` and `hybridrec serve
--watch` together on the Criteo sample cut into time-ordered files (first file: the
frozen reference statistics and the first export). Every `--interval` seconds it
scores the next file's rows on the server (the prequential test: the served model has
not trained on them yet), then renames the file into the watched folder. It measures
per file the time from its rename until the server answers with a model version whose
export has trained on every row of it (`published.jsonl` of the run maps versions to
the shards they cover). With `--kill-trainer` the trainer gets a kill -9 after half the
files and is restarted with --resume at once; with `--kill-follower` the follower gets
one three files later and is restarted at once.

At the end: rows of every input file against the rows trained per shard in the final
checkpoint (lost: in a file, not rejected, not trained; duplicated: trained more than
once), and a batch baseline: the same rows preprocessed at once (last 10% eval), one
epoch of the same preset, its eval AUC against the prequential AUC on the same tail.

    python scripts/bench_online.py                   # the shared Criteo sample
    python scripts/bench_online.py --kill-trainer    # the same with a kill -9 mid-stream
    python scripts/bench_online.py --kill-trainer --kill-follower

Last line: one JSON object (freshness_p50_s, freshness_p99_s, rows_lost, rows_duplicated,
prequential_auc, batch_auc, prequential_auc_tail, ...).
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SAMPLE = REPO.parent / "shared" / "data" / "criteo_kaggle_sample" / "train.tsv.gz"
PRESET = "criteo_dlrm"
ENV = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}  # one CPU device


def hybridrec(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hybridrec", *args], cwd=REPO, env=ENV, **popen)


def run(*args: str) -> None:
    process = hybridrec(*args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = process.communicate()[0]
    if process.returncode:
        sys.exit(f"hybridrec {' '.join(args)} failed:\n{output[-3000:]}")


def cut_files(source: Path, rows: int, files: int, out: Path) -> list[list[bytes]]:
    """The first `rows` lines of `source` as `files` consecutive (time-ordered) files."""
    opener = gzip.open if source.suffix == ".gz" else open
    lines = []
    with opener(source, "rb") as handle:
        for line in handle:
            lines.append(line)
            if rows and len(lines) >= rows:
                break
    parts = np.array_split(np.arange(len(lines)), files)
    out.mkdir(parents=True)
    cut = []
    for index, part in enumerate(parts):
        chunk = [lines[i] for i in part]
        (out / f"part-{index:03d}.tsv").write_bytes(b"".join(chunk))
        cut.append(chunk)
    return cut


class Server:
    """`hybridrec serve --watch` on a free port; `infer(lines)` -> (version, probabilities)."""

    def __init__(self, export: Path, log: Path):
        self.process = hybridrec(
            "serve", str(export), "--port", "0", "--watch", "--max-rows", "100000",
            stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
        )  # fmt: skip
        line = self.process.stdout.readline()
        if "http://" not in line:
            sys.exit(f"hybridrec serve did not start: {line!r} (see {log})")
        self.host, self.port = line.split("http://", 1)[1].split()[0].rsplit(":", 1)
        self.name = json.loads(next(export.glob("*/manifest.json")).read_text())["name"]

    def infer(self, lines: list[bytes]) -> tuple[int, np.ndarray]:
        body = {"inputs": [{"name": "rows", "datatype": "BYTES", "shape": [len(lines)],
                            "data": [line.rstrip(b"\n").decode() for line in lines]}]}  # fmt: skip
        connection = http.client.HTTPConnection(self.host, int(self.port), timeout=120)
        connection.request("POST", f"/v2/models/{self.name}/infer", json.dumps(body),
                           {"Content-Type": "application/json"})  # fmt: skip
        response = connection.getresponse()
        answer = json.loads(response.read())
        connection.close()
        if response.status != 200:
            raise RuntimeError(f"infer: {response.status} {answer}")
        return int(answer["model_version"]), np.asarray(answer["outputs"][0]["data"], np.float32)


def watch_versions(server: Server, probe: list[bytes], seen: dict, stop: threading.Event):
    """Records when the server first answers with each version (one-row requests, 5 per s)."""
    while not stop.wait(0.2):
        try:
            version, _ = server.infer(probe)
        except (OSError, RuntimeError, http.client.HTTPException):
            continue
        seen.setdefault(version, time.time())


def published(run_dir: Path) -> dict[int, int]:
    """Export version -> shards complete in it (from the run's published.jsonl)."""
    path = run_dir / "published.jsonl"
    if not path.exists():
        return {}
    return {
        record["version"]: record["shards_complete"]
        for record in map(json.loads, path.read_text().split("\n")[:-1])  # not a torn tail
    }


def auc(probabilities: np.ndarray, labels: np.ndarray) -> float:
    from hybridrec.model.metrics import StreamingMetrics

    metrics = StreamingMetrics()
    metrics.update(probabilities, labels)
    return float(metrics.result()["auc"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", type=Path, default=SAMPLE, help="Criteo-format TSV[.gz]")
    parser.add_argument("--rows", type=int, default=0, help="rows used (0: all)")
    parser.add_argument("--files", type=int, default=20, help="time-ordered files to cut")
    parser.add_argument("--interval", type=float, default=4.0, help="seconds between files")
    parser.add_argument("--publish-every", type=float, default=5.0)
    parser.add_argument("--score-rows", type=int, default=2000, help="rows per file scored")
    parser.add_argument("--kill-trainer", action="store_true", help="kill -9 mid-stream")
    parser.add_argument("--kill-follower", action="store_true",
                        help="kill -9 of the follower 3 files after the middle")  # fmt: skip
    parser.add_argument("--work", type=Path, help="work directory (default: a temporary one)")
    parser.add_argument("--set", action="append", default=["data.batch_size=512"],
                        help="training override (repeatable)")  # fmt: skip
    args = parser.parse_args()
    if not args.input.exists():
        sys.exit(f"{args.input}: no such input (pass --input FILE)")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_online_"))
    print(f"== work directory {work}", flush=True)
    source, inputs = work / "source", work / "in"
    cut = cut_files(args.input, args.rows, args.files, source)
    inputs.mkdir()
    total_rows = sum(len(chunk) for chunk in cut)
    first_row = np.cumsum([0] + [len(chunk) for chunk in cut])
    tail_start = total_rows - int(round(total_rows * 0.1))
    print(f"== {total_rows:,} rows in {args.files} files; reference: file 0", flush=True)
    run("preprocess", "--input", str(source / "part-000.tsv"), "--output", str(work / "reference"))

    stream, run_dir, export = work / "stream", work / "run", work / "export"
    sets = [item for key in args.set for item in ("--set", key)]
    follower_args = [
        "preprocess", "--follow", "--input", str(inputs / "*.tsv"), "--output", str(stream),
        "--stats", str(work / "reference"), "--poll-interval", "0.2", "--settle-seconds", "0.2",
    ]  # fmt: skip
    follower_log = (work / "follower.log").open("a")
    follower = hybridrec(*follower_args, stderr=follower_log, stdout=follower_log)
    trainer_args = [
        "train", "--follow", str(stream), "--run-dir", str(run_dir), "--config", PRESET, *sets,
        "--publish-every", str(args.publish_every), "--checkpoint-every", "30",
        "--export", str(export), "--flush-after", "0.5",
    ]  # fmt: skip
    trainer_log = (work / "trainer.log").open("a")
    trainer = hybridrec(*trainer_args, stderr=trainer_log, stdout=trainer_log)
    dropped: dict[int, float] = {}

    def drop(index: int) -> None:
        os.link(source / f"part-{index:03d}.tsv", inputs / f".part-{index:03d}.tsv")
        os.replace(inputs / f".part-{index:03d}.tsv", inputs / f"part-{index:03d}.tsv")
        dropped[index] = time.time()

    drop(0)
    while not (export / "1" / "manifest.json").exists():
        if trainer.poll() is not None:
            sys.exit(f"the trainer exited {trainer.returncode}; see {work / 'trainer.log'}")
        time.sleep(0.2)
    server = Server(export, work / "server.log")
    seen: dict[int, float] = {}
    stop = threading.Event()
    poller = threading.Thread(target=watch_versions, args=(server, cut[0][:1], seen, stop))
    poller.start()
    scores, labels, positions = [], [], []
    restart_seconds = None
    for index in range(1, args.files):
        started = time.time()
        chunk = cut[index]
        pick = np.linspace(0, len(chunk) - 1, min(args.score_rows, len(chunk))).astype(int)
        version, probabilities = server.infer([chunk[i] for i in pick])
        scores.append(probabilities)
        labels.append(np.array([float(chunk[i].split(b"\t", 1)[0]) for i in pick], np.float32))
        positions.append(first_row[index] + pick)
        drop(index)
        print(f"   file {index}: scored {len(pick)} rows on version {version}, dropped", flush=True)
        if args.kill_trainer and index == args.files // 2:
            trainer.send_signal(signal.SIGKILL)
            trainer.wait()
            killed = time.time()
            print(f"   kill -9 of the trainer after file {index}; restarting", flush=True)
            trainer = hybridrec(*trainer_args, "--resume", stderr=trainer_log, stdout=trainer_log)
            restart_at = len(published(run_dir))
            while len(published(run_dir)) == restart_at and trainer.poll() is None:
                time.sleep(0.2)
            restart_seconds = time.time() - killed
        if args.kill_follower and index == args.files // 2 + 3:
            time.sleep(0.3)  # inside the follower's run over this file, most likely
            follower.send_signal(signal.SIGKILL)
            follower.wait()
            print(f"   kill -9 of the follower after file {index}; restarting", flush=True)
            follower = hybridrec(*follower_args, stderr=follower_log, stdout=follower_log)
        time.sleep(max(0.0, started + args.interval - time.time()))

    deadline = time.time() + 300
    while time.time() < deadline:  # until the server answers with a version that has it all
        covered = published(run_dir)
        if any(covered.get(v, 0) >= args.files for v in seen):
            break
        time.sleep(0.5)
    stop.set()
    poller.join()
    for process in (trainer, follower, server.process):
        process.send_signal(signal.SIGTERM)
    for process in (trainer, follower, server.process):
        process.wait(120)

    covered = published(run_dir)
    freshness = []
    for index in range(1, args.files):
        answered = [t for v, t in seen.items() if covered.get(v, 0) > index]
        freshness.append(min(answered) - dropped[index] if answered else float("inf"))
    last = json.loads((run_dir / "checkpoints" / "LAST").read_text())["step"]
    saved = json.loads(
        (run_dir / "checkpoints" / "positions" / f"{last:010d}" / "process_0.json").read_text()
    )
    entries = [json.loads(line) for line in (stream / "manifest.jsonl").read_text().splitlines()]
    shards = [e for e in entries if e["kind"] == "shard"]
    rejected = {Path(e["source"]).name: e.get("rejected", 0) for e in entries}
    lost = duplicated = 0
    for index, chunk in enumerate(cut):
        name = f"part-{index:03d}.tsv"
        expected = len(chunk) - rejected.get(name, 0)
        # a file committed twice would be two shards: their rows add up
        trained = sum(
            saved["rows_by_shard"].get(str(i), 0)
            for i, e in enumerate(shards)
            if Path(e["source"]).name == name
        )
        lost += max(0, expected - trained)
        duplicated += max(0, trained - expected)

    print("== batch baseline: the same rows preprocessed at once, one epoch", flush=True)
    run("preprocess", "--input", *[str(p) for p in sorted(source.glob("*.tsv"))],
        "--output", str(work / "batch"))  # fmt: skip
    run("train", "--data", str(work / "batch"), "--run-dir", str(work / "batch_run"),
        "--config", PRESET, *sets, "--quiet")  # fmt: skip
    batch = json.loads((work / "batch_run" / "summary.json").read_text())["eval"]

    scores_all, labels_all, where = map(np.concatenate, (scores, labels, positions))
    tail = where >= tail_start
    result = {
        "freshness_p50_s": round(float(np.percentile(freshness, 50)), 2),
        "freshness_p99_s": round(float(np.percentile(freshness, 99)), 2),
        "freshness_max_s": round(float(max(freshness)), 2),
        "rows_lost": int(lost),
        "rows_duplicated": int(duplicated),
        "prequential_auc": round(auc(scores_all, labels_all), 4),
        "prequential_auc_tail": round(auc(scores_all[tail], labels_all[tail]), 4),
        "batch_auc": round(float(batch["auc"]), 4),
        "rows": int(total_rows),
        "files": args.files,
        "interval_s": args.interval,
        "publish_every_s": args.publish_every,
        "versions_published": len(covered),
        "kill_trainer": args.kill_trainer,
        "kill_follower": args.kill_follower,
        "trainer_restart_to_publish_s": round(restart_seconds, 2) if restart_seconds else None,
        "rows_trained_in_checkpoint": int(saved["rows"]),
    }
    print(f"   freshness per file (s): {[round(f, 1) for f in freshness]}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
