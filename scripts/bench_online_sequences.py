"""Online training of a sequential recommender end to end: event files dropped into a folder
-> a served top-K that trained on them, through kill -9s of every process.

Generates an event log (`hybridrec generate --events`), cuts it in time order: the first
`--reference` share is preprocessed as the reference (frozen spec, hash scheme, catalogue,
each user's history), the rest becomes `--files` files. Then it runs `hybridrec
preprocess --follow` (each file extends its users' kept histories), `hybridrec train
--follow` (SASRec; each file evaluated as a window before it is trained) and `hybridrec
serve --watch` together, renames a file into the watched folder every `--interval`
seconds, and measures per file the time from its rename until the server answers a
retrieval request with a version whose export trained every event of it
(`published.jsonl` maps versions to the shards they cover).

The stream starts from a batch SASRec run on the reference (`--batch-epochs`, 10; 0:
from a new model). With the kills (default; `--no-kills` runs without): the follower gets a kill -9 a third
of the way, the trainer at half, the server at two thirds; each is restarted at once (the
trainer with --resume).

At the end: per file, its events against those the follower committed (new, duplicate,
rejected) and the targets of its shard against the positions the final checkpoint trained
(lost: committed, not trained; duplicated: trained more than once).

    python scripts/bench_online_sequences.py
    python scripts/bench_online_sequences.py --users 20000 --files 30 --no-kills

Last line: one JSON object (freshness_p50_s, freshness_p99_s, events_lost,
events_duplicated, window_hr@10_mean, window_popularity_hr@10_mean: the prequential
popularity baseline on the same windows, ...).
"""

from __future__ import annotations

import argparse
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
ENV = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}  # one CPU device


def hybridrec(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hybridrec", *args], cwd=REPO, env=ENV, **popen)


def run(*args: str) -> None:
    process = hybridrec(*args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = process.communicate()[0]
    if process.returncode:
        sys.exit(f"hybridrec {' '.join(args)} failed:\n{output[-3000:]}")


class Server:
    """`hybridrec serve --watch` on a free port; `retrieve(history)` -> (version, items)."""

    def __init__(self, export: Path, log: Path):
        self.process = hybridrec(
            "serve", str(export), "--port", "0", "--watch",
            stdout=subprocess.PIPE, stderr=log.open("a"), text=True,
        )  # fmt: skip
        line = self.process.stdout.readline()
        if "http://" not in line:
            sys.exit(f"hybridrec serve did not start: {line!r} (see {log})")
        self.host, self.port = line.split("http://", 1)[1].split()[0].rsplit(":", 1)
        self.name = json.loads(next(export.glob("*/manifest.json")).read_text())["name"]

    def retrieve(self, events: list[list[str]], k: int = 10) -> tuple[int, list[str]]:
        """Top-k after `events` [(item, time, action)] (a model ignores what it does not read)."""
        items, times, actions = zip(*events, strict=True)
        inputs = [
            {"name": "history", "datatype": "BYTES", "shape": [len(items)], "data": list(items)},
            {"name": "times", "datatype": "INT64", "shape": [len(times)], "data": [int(t) for t in times]},
            {"name": "actions", "datatype": "BYTES", "shape": [len(actions)], "data": list(actions)},
        ]  # fmt: skip
        body = json.dumps({"inputs": inputs, "parameters": {"k": k}})
        connection = http.client.HTTPConnection(self.host, int(self.port), timeout=60)
        connection.request("POST", f"/v2/models/{self.name}/infer", body, {"Content-Type": "application/json"})  # fmt: skip
        response = connection.getresponse()
        answer = json.loads(response.read())
        connection.close()
        if response.status != 200:
            raise RuntimeError(f"infer: {response.status} {answer}")
        items = next(o for o in answer["outputs"] if o["name"] == "items")["data"]
        return int(answer["model_version"]), items


class Watcher:
    """Records when the server (restarted or not) first answers with each version."""

    def __init__(self, probe: list[str]):
        self.probe, self.server, self.seen = probe, None, {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            server = self.server
            if server is None:
                continue
            try:
                version, _ = server.retrieve(self.probe)
            except (OSError, RuntimeError, http.client.HTTPException, ValueError):
                continue
            self.seen.setdefault(version, time.time())


def published(run_dir: Path) -> dict[int, int]:
    """Export version -> shards complete in it (from the run's published.jsonl)."""
    path = run_dir / "published.jsonl"
    if not path.exists():
        return {}
    lines = path.read_text().split("\n")[:-1]  # not a torn tail
    return {r["version"]: r["shards_complete"] for r in map(json.loads, lines)}


def popularity_windows(reference: Path, stream: Path, k: int = 10) -> list[float]:
    """Per shard, HR@k of the prequential popularity baseline: each new event's item ranked
    by its count among the reference's training rows and the earlier shards' new events
    (ties by item id; the user's history kept, as the window records' `hr@10_history_kept`)."""
    from hybridrec.pipeline import read_shards
    from hybridrec.pipeline.metadata import read_dataset
    from hybridrec.training.sequences.batches import Catalogue, Histories

    catalogue = Catalogue.of(Histories.read(read_dataset(reference), "train"))
    rates = []
    for entry in read_shards(stream):
        if not entry.rows:
            continue
        rows = Histories.read_files([stream / entry.shard], actions=False)
        first = np.maximum(rows.first_target, 1)
        starts, stops = rows.offsets[:-1] + first, rows.offsets[1:]
        targets = rows.items[np.concatenate([np.arange(a, b) for a, b in zip(starts, stops, strict=True)])]  # fmt: skip
        rates.append(float(np.mean(popularity_ranks(catalogue, targets) < k)))
        catalogue = catalogue.merged(targets)
    return rates


def popularity_ranks(catalogue, targets: np.ndarray) -> np.ndarray:
    """Per target, the catalogue items ranked above it: a higher count, or the same count
    and a smaller id (an item not in the catalogue ranks last)."""
    order = np.lexsort((catalogue.items, catalogue.counts))  # count, then id, ascending
    counts, items = catalogue.counts[order], catalogue.items[order]
    where = np.minimum(np.searchsorted(catalogue.items, targets), len(catalogue) - 1)
    count = np.where(catalogue.items[where] == targets, catalogue.counts[where], 0)
    ranks = len(counts) - np.searchsorted(counts, count, side="right")
    for value in np.unique(count[count > 0]):
        low, high = np.searchsorted(counts, value, "left"), np.searchsorted(counts, value, "right")
        mine = count == value
        ranks[mine] += np.searchsorted(items[low:high], targets[mine])
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=8000)
    parser.add_argument("--items", type=int, default=5000)
    parser.add_argument("--mean-events", type=float, default=25.0)
    parser.add_argument("--reference", type=float, default=0.6, help="share of events in the reference")  # fmt: skip
    parser.add_argument("--files", type=int, default=20, help="stream files")
    parser.add_argument("--interval", type=float, default=4.0, help="seconds between files")
    parser.add_argument("--publish-every", type=float, default=5.0)
    parser.add_argument("--no-kills", action="store_true", help="no kill -9 of any process")
    parser.add_argument("--batch-epochs", type=int, default=10,
                        help="epochs of a batch run on the reference the stream starts from (--init-from); 0: a new model")  # fmt: skip
    parser.add_argument("--work", type=Path, help="work directory (default: a temporary one)")
    parser.add_argument("--set", action="append", default=[], help="training override (repeatable)")  # fmt: skip
    args = parser.parse_args()
    from hybridrec.pipeline.events.synthetic_events import split_by_time

    work = args.work or Path(tempfile.mkdtemp(prefix="bench_online_sequences_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"== work directory {work}", flush=True)
    raw, source, inputs = work / "raw", work / "source", work / "in"
    run("generate", "--events", "--output", str(raw), "--users", str(args.users),
        "--items", str(args.items), "--mean-events", str(args.mean_events), "--seed", "1")  # fmt: skip
    source.mkdir()
    inputs.mkdir()
    names = [source / f"events-{i:03d}.csv" for i in range(args.files)]
    counts = split_by_time(raw / "events.csv", raw / "reference.csv", names, fraction=args.reference)  # fmt: skip
    print(f"== {sum(counts):,} events: {counts[0]:,} in the reference, {args.files} files of ~{counts[1]:,}", flush=True)  # fmt: skip
    run("preprocess", "--input", str(raw / "reference.csv"), "--spec", str(raw / "events.toml"),
        "--output", str(work / "reference"), "--quiet")  # fmt: skip
    lines = (raw / "reference.csv").read_text().splitlines()[1:21]
    probe = [line.split(",")[1:4] for line in lines]  # item, time, action

    stream, run_dir, export = work / "stream", work / "run", work / "export"
    model = ["--set", "model.sequence.max_length=50", "--set", "data.batch_size=64"]
    model += [item for key in args.set for item in ("--set", key)]
    start = []
    if args.batch_epochs:
        print(f"== a batch run on the reference: {args.batch_epochs} epochs", flush=True)
        batch_started = time.time()
        run("train", "--data", str(work / "reference"), "--run-dir", str(work / "batch"),
            "--config", "sasrec", *model, "--set", f"data.epochs={args.batch_epochs}", "--quiet")  # fmt: skip
        batch_s = time.time() - batch_started
        start = ["--init-from", str(work / "batch")]
    follower_args = [
        "preprocess", "--follow", "--input", str(inputs / "*.csv"), "--output", str(stream),
        "--stats", str(work / "reference"), "--poll-interval", "0.2", "--settle-seconds", "0.2",
    ]  # fmt: skip
    trainer_args = [
        "train", "--follow", str(stream), "--run-dir", str(run_dir), "--config", "sasrec", *model,
        "--publish-every", str(args.publish_every), "--checkpoint-every", "10",
        "--export", str(export), "--flush-after", "0.5", *start,
    ]  # fmt: skip
    logs = {name: (work / f"{name}.log").open("a") for name in ("follower", "trainer")}
    follower = hybridrec(*follower_args, stderr=logs["follower"], stdout=logs["follower"])
    trainer = hybridrec(*trainer_args, stderr=logs["trainer"], stdout=logs["trainer"])
    dropped: dict[int, float] = {}

    def drop(index: int) -> None:
        os.link(names[index], inputs / f".{names[index].name}")
        os.replace(inputs / f".{names[index].name}", inputs / names[index].name)
        dropped[index] = time.time()

    drop(0)
    while not (export / "1" / "manifest.json").exists():
        if trainer.poll() is not None:
            sys.exit(f"the trainer exited {trainer.returncode}; see {work / 'trainer.log'}")
        time.sleep(0.2)
    watcher = Watcher(probe)
    watcher.server = Server(export, work / "server.log")
    kills = {} if args.no_kills else {args.files // 3: "follower", args.files // 2: "trainer", 2 * args.files // 3: "server"}  # fmt: skip
    restarts = {}
    for index in range(1, args.files):
        started = time.time()
        drop(index)
        print(f"   file {index} dropped; served versions so far: {len(watcher.seen)}", flush=True)
        victim = kills.get(index)
        if victim:
            time.sleep(0.3)  # inside its handling of this file, most likely
            process = {"follower": follower, "trainer": trainer, "server": watcher.server.process}[victim]  # fmt: skip
            process.send_signal(signal.SIGKILL)
            process.wait()
            killed = time.time()
            print(f"   kill -9 of the {victim} after file {index}; restarting", flush=True)
            if victim == "follower":
                follower = hybridrec(*follower_args, stderr=logs["follower"], stdout=logs["follower"])  # fmt: skip
            elif victim == "trainer":
                trainer = hybridrec(*trainer_args, "--resume", stderr=logs["trainer"], stdout=logs["trainer"])  # fmt: skip
            else:
                watcher.server = Server(export, work / "server.log")
            restarts[victim] = round(time.time() - killed, 2)
        time.sleep(max(0.0, started + args.interval - time.time()))

    deadline = time.time() + 600
    while time.time() < deadline:  # until the server answers with a version that has it all
        covered = published(run_dir)
        if any(covered.get(v, 0) >= args.files for v in watcher.seen):
            break
        time.sleep(0.5)
    watcher.stop.set()
    watcher.thread.join()
    for process in (trainer, follower, watcher.server.process):
        process.send_signal(signal.SIGTERM)
    for process in (trainer, follower, watcher.server.process):
        process.wait(120)

    covered = published(run_dir)
    freshness = []
    for index in range(args.files):
        answered = [t for v, t in watcher.seen.items() if covered.get(v, 0) > index]
        freshness.append(min(answered) - dropped[index] if answered else float("inf"))
    last = json.loads((run_dir / "checkpoints" / "LAST").read_text())["step"]
    position = run_dir / "checkpoints" / "positions" / f"{last:010d}" / "process_0.json"
    saved = json.loads(position.read_text())
    entries = [json.loads(line) for line in (stream / "manifest.jsonl").read_text().splitlines()]
    shards = [e for e in entries if e["kind"] == "shard"]
    lost = duplicated = unaccounted = 0
    for index, name in enumerate(names):
        mine = [(i, e) for i, e in enumerate(shards) if Path(e["source"]).name == name.name]
        committed = sum(e["events"] + e["duplicates"] + e["rejected"] for _, e in mine)
        unaccounted += abs(counts[index + 1] - committed)  # a file committed twice: 2x
        targets = sum(e["targets"] for _, e in mine)
        trained = sum(saved["rows_by_shard"].get(str(i), 0) for i, _ in mine)
        lost += max(0, targets - trained)
        duplicated += max(0, trained - targets)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = {r["window"]: r for r in records if r["kind"] == "window"}
    hr = [windows[w]["hr@10"] for w in sorted(windows)]
    kept = [windows[w].get("hr@10_history_kept", windows[w]["hr@10"]) for w in sorted(windows)]
    popular = popularity_windows(work / "reference", stream)
    result = {
        "freshness_p50_s": round(float(np.percentile(freshness, 50)), 2),
        "freshness_p99_s": round(float(np.percentile(freshness, 99)), 2),
        "freshness_max_s": round(float(max(freshness)), 2),
        "events_lost": int(lost),
        "events_duplicated": int(duplicated),
        "events_unaccounted_by_follower": int(unaccounted),
        "events_trained": int(saved["rows"]),
        "window_hr@10_mean": round(float(np.mean(hr)), 4) if hr else None,
        "window_hr@10_first_last": [round(hr[0], 4), round(hr[-1], 4)] if hr else None,
        "window_hr@10_history_kept_mean": round(float(np.mean(kept)), 4) if kept else None,
        "window_popularity_hr@10_mean": round(float(np.mean(popular)), 4) if popular else None,
        "windows_evaluated": len(windows),
        "batch_epochs": args.batch_epochs,
        "batch_train_s": round(batch_s, 1) if args.batch_epochs else None,
        "reference_events": counts[0],
        "stream_events": int(sum(counts[1:])),
        "files": args.files,
        "interval_s": args.interval,
        "publish_every_s": args.publish_every,
        "versions_published": len(covered),
        "kills": sorted(kills.values()),
        "restart_s": restarts,
    }
    print(f"   freshness per file (s): {[round(f, 1) for f in freshness]}")
    print(f"   window HR@10 (history kept) per file: {[round(h, 3) for h in kept]}")
    print(f"   popularity HR@10 per file:           {[round(h, 3) for h in popular]}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
