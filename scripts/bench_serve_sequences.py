"""Serving a sequence run: top-K over a large catalogue through `hybridrec serve`.

1. A generated event log whose training split holds about --items distinct items
   (popularity flattened, --zipf, so that nearly every item occurs), preprocessed, and
   SASRec (max_length --history) trained through the hybrid loop, the preset's 20 epochs
   (or --epochs) at its item-table learning rate (or --sparse-learning-rate); exported at
   fp32, fp16 and int8. Cached under --cache by its arguments: the log once, each training
   of it in a folder of its own.
2. A real `hybridrec serve` process on a loopback port (--keep-histories): --clients
   closed-loop clients for --duration seconds, each request one user's history of
   --history raw item ids (drawn from the catalogue) asking for the top --k items, the
   history excluded: p50 / p99 latency and requests/s. The clients run on the same
   machine and count against it.
3. Recall@k of the int8 and the fp16 exports' top-k against the fp32 export's, on the
   validation split's histories; and how far the model is from chance: its last training
   loss against ln(catalogue) (a sampled softmax's corrected loss at chance), and the
   fp32 export's HR@10 on those histories' validation items.
4. The kept-history cache: a user's query from its cached keys and values plus one new
   event, against computing the whole history (in process, one user a call, the tower's
   part only), and end to end over HTTP (a request naming the user after one appended
   event, against the same history sent whole).

    python scripts/bench_serve_sequences.py                     # about 1M items
    python scripts/bench_serve_sequences.py --items 20000 --duration 5

The last line is one JSON object: catalogue, p50_ms, p99_ms, requests_per_s, errors,
recall_at_k_int8 and recall_at_k_fp16 (k = --k), cached_speedup (the tower's part), cached_request_p50_ms,
full_request_p50_ms, cached_request_speedup, train_loss, loss_at_chance, hr_at_10_valid.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import Server, load  # noqa: E402  the same server harness and load loop

REPO = Path(__file__).resolve().parent.parent
PRECISIONS = ("fp32", "fp16", "int8")


def trained_exports(args) -> tuple[Path, Path, dict[str, Path]]:
    """(data, run, {precision: export}) for fp32, fp16 and int8, made once per set of
    arguments."""
    from hybridrec.serving.export import export_run

    events = args.items * args.events_per_item
    users = max(events // args.mean_events, 1)
    base = Path(args.cache) / f"serve_seq_i{args.items}_e{args.events_per_item}_h{args.history}"
    training = f"ep{args.epochs}"  # each training of the log: its run and exports
    if args.sparse_learning_rate is not None:
        training += f"_slr{args.sparse_learning_rate:g}"
    root = base / training
    data, run = base / "data", root / "run"
    exports = {precision: root / f"export_{precision}" for precision in PRECISIONS}
    if not (run / "summary.json").exists():
        _train(args, data, run, base, events, users)
    for precision, path in exports.items():  # each made once
        if not (path / "1" / "manifest.json").exists():
            export_run(run, path, precision=precision, name="sequences")
    return data, run, exports


def _train(args, data: Path, run: Path, root: Path, events: int, users: int) -> None:
    """The generated log preprocessed into `data` (once), and SASRec trained into `run`."""
    from hybridrec.pipeline.config import PreprocessConfig
    from hybridrec.pipeline.events.event_job import run_event_preprocess
    from hybridrec.pipeline.events.synthetic_events import (
        EventLogConfig,
        generate_events,
        spec_text,
    )
    from hybridrec.training.config import load_config
    from hybridrec.training.trainer import Trainer

    if not (data / "_SUCCESS").exists():
        print(f"== generate {events:,} events of {users:,} users", file=sys.stderr, flush=True)
        raw = root / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        config = EventLogConfig(
            users=users, items=args.items, topics=200, mean_events=args.mean_events,
            zipf=args.zipf, seed=1,
        )  # fmt: skip
        generate_events(raw / "events.csv", raw / "items.csv", config)
        (raw / "events.toml").write_text(spec_text("items.csv"))
        settings = PreprocessConfig(
            inputs=[str(raw / "events.csv")], output=str(data), spec=str(raw / "events.toml")
        )
        run_event_preprocess(settings)
    print(f"== train SASRec {args.epochs} epoch(s)", file=sys.stderr, flush=True)
    rate = args.sparse_learning_rate
    config = load_config(
        "sasrec",
        [
            f"data.path={json.dumps(str(data))}",
            f"model.sequence.max_length={args.history}",
            f"data.epochs={args.epochs}",
            *([f"embedding.optimizer.learning_rate={rate}"] if rate is not None else []),
            "data.token_budget=8192",
            # epochs as asked, not stopped at a best: full ranking of a 1M catalogue on
            # validation is not what this measures
            "eval.every_steps=0",
            "train.patience=0",
            'checkpoint.keep_best=""',
            "embedding.capacity=4000000",
            "log.every_steps=50",
            # requests carry items only, as measured before action types were inputs
            "model.sequence.action_inputs=0",
        ],
    )
    trainer = Trainer(config, run, overwrite=True)
    trainer.schedule = dataclasses.replace(trainer.schedule, evaluates=False)  # not even at the end
    trainer.fit()


def history_bodies(model, count: int, length: int, k: int, seed: int) -> list[bytes]:
    """Requests of one user's `length` raw item ids drawn from the catalogue."""
    rng = np.random.default_rng(seed)
    bodies = []
    for _ in range(count):
        names = model.item_names(model.catalogue[rng.integers(len(model.catalogue), size=length)])
        tensor = {"name": "history", "datatype": "BYTES", "shape": [length], "data": names}
        bodies.append(json.dumps({"inputs": [tensor], "parameters": {"k": k}}).encode())
    return bodies


def validation_histories(data: Path, users: int) -> tuple[list[np.ndarray], np.ndarray]:
    """(histories, validation items) of up to `users` users of the validation split, each
    history its events before the validation item."""
    from hybridrec.pipeline.metadata import read_dataset
    from hybridrec.training.sequences.batches import Histories

    histories = Histories.read(read_dataset(data), "valid")
    chosen = np.linspace(0, len(histories) - 1, min(users, len(histories))).astype(int)
    ends = histories.offsets[chosen + 1]
    chosen = chosen[ends - 1 > histories.offsets[chosen]]  # a history before its item
    queries = [histories.items[histories.offsets[h] : histories.offsets[h + 1] - 1] for h in chosen]
    return queries, histories.items[histories.offsets[chosen + 1] - 1]


def recall(queries: list[np.ndarray], exact: np.ndarray, other) -> float:
    """Mean |top-k of `other` ∩ `exact`| / k over the histories `queries`, `exact` [n, k]
    the fp32 export's top-k of them."""
    k = exact.shape[1]
    approximate, _ = other.top_k(other.encode(queries)[0], k, queries)
    found = [len(np.intersect1d(a, b)) for a, b in zip(exact, approximate, strict=True)]
    return float(np.mean(found) / k)


def hit_rate(top: np.ndarray, targets: np.ndarray) -> float:
    """The fraction of rows of `top` [n, k] that hold their history's next item."""
    return float(np.mean([target in items for items, target in zip(top, targets, strict=True)]))


def last_train_loss(run: Path) -> float:
    """The training loss of the run's last train record."""
    from hybridrec.training.run_log import read_records

    return float([record for record in read_records(run) if record["kind"] == "train"][-1]["loss"])


def cached_speedup(model, length: int, users: int, seed: int) -> float:
    """Seconds of the tower's part for a whole `length`-event history over those for the
    same history's last event with the earlier ones cached (one user a call)."""
    rng = np.random.default_rng(seed)
    histories = [
        model.catalogue[rng.integers(len(model.catalogue), size=length)] for _ in range(users)
    ]
    _, _, _, caches, _ = model.encode_kept([h[:-1] for h in histories], [None] * users)
    for history, cache in zip(histories[:2], caches[:2], strict=True):  # compile both shapes
        model.encode([history])
        model.encode_kept([history], [cache])
    started = time.perf_counter()
    for history in histories:
        model.encode([history])
    full = time.perf_counter() - started
    started = time.perf_counter()
    for history, cache in zip(histories, caches, strict=True):
        _, _, _, _, computed = model.encode_kept([history], [cache])
        assert computed[0] == 1, computed
    return full / (time.perf_counter() - started)


def request_latencies(server: Server, model, length: int, k: int, count: int, seed: int):
    """(p50 ms of a request naming a kept user after one appended event, p50 ms of the same
    history sent whole), sequential requests on one connection."""
    rng = np.random.default_rng(seed)
    connection = http.client.HTTPConnection(server.host, int(server.port), timeout=60)

    def post(path: str, body: dict) -> dict:
        connection.request("POST", f"/v2/models/{server.model}/{path}", json.dumps(body).encode())
        response = connection.getresponse()
        answer = json.loads(response.read())
        assert response.status == 200, answer
        return answer

    def events(user: str, items: list[str]) -> dict:
        users = {
            "name": "users",
            "datatype": "BYTES",
            "shape": [len(items)],
            "data": [user] * len(items),
        }
        rows = {"name": "items", "datatype": "BYTES", "shape": [len(items)], "data": items}
        return {"inputs": [users, rows]}

    cached, full = [], []
    for index in range(count):
        user = f"bench-user-{index}"
        names = model.item_names(model.catalogue[rng.integers(len(model.catalogue), size=length)])
        post("events", events(user, names[:-1]))
        by_user = {
            "inputs": [{"name": "users", "datatype": "BYTES", "shape": [1], "data": [user]}],
            "parameters": {"k": k},
        }
        post("infer", by_user)  # computes and caches the first length - 1 events
        post("events", events(user, names[-1:]))
        began = time.perf_counter()
        answer = post("infer", by_user)
        cached.append(time.perf_counter() - began)
        assert answer["parameters"]["computed_events"] == 1, answer["parameters"]
        whole = {
            "inputs": [{"name": "history", "datatype": "BYTES", "shape": [length], "data": names}],
            "parameters": {"k": k},
        }
        began = time.perf_counter()
        post("infer", whole)
        full.append(time.perf_counter() - began)
    connection.close()
    return float(np.median(cached) * 1e3), float(np.median(full) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1_050_000, help="items in the log")
    parser.add_argument("--events-per-item", type=int, default=4, help="events = items x this")
    parser.add_argument("--mean-events", type=int, default=40, help="mean events a user")
    parser.add_argument("--zipf", type=float, default=0.0, help="popularity exponent")
    parser.add_argument("--history", type=int, default=200, help="events a request carries")
    parser.add_argument("--epochs", type=int, help="epochs SASRec trains (default: the preset's)")
    parser.add_argument(
        "--sparse-learning-rate", type=float, help="the item table's (default: the preset's)"
    )
    parser.add_argument("--k", type=int, default=100, help="items a request asks for")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    parser.add_argument("--recall-users", type=int, default=500, help="histories for recall")
    parser.add_argument("--cache", default=str(REPO / "runs" / "bench_cache"))
    args = parser.parse_args()

    from hybridrec.serving.sequence_model import ServedSequenceModel
    from hybridrec.training.config import load_config

    if args.epochs is None:
        args.epochs = load_config("sasrec", []).data.epochs

    data, run, exports = trained_exports(args)
    fp32_dir = exports["fp32"]
    fp32 = ServedSequenceModel(fp32_dir, max_batch=64)
    catalogue = len(fp32.catalogue)
    print(f"== catalogue of {catalogue:,} items; recall of int8, fp16", file=sys.stderr, flush=True)  # fmt: skip
    queries, targets = validation_histories(data, args.recall_users)
    # fp32's top max(k, 10) once: its first k for recall (ties in catalogue order), 10 for HR@10
    top, _ = fp32.top_k(fp32.encode(queries)[0], max(args.k, 10), queries)
    recalls = {}
    for precision in ("int8", "fp16"):
        other = ServedSequenceModel(exports[precision], max_batch=64)
        recalls[precision] = recall(queries, top[:, : args.k], other)
        del other
    hr10 = hit_rate(top[:, :10], targets)
    loss, chance = last_train_loss(run), float(np.log(catalogue))
    speedup = cached_speedup(fp32, args.history, 32, seed=3)
    print(
        f"   recall@{args.k} against fp32: int8 {recalls['int8']:.4f}, fp16 "
        f"{recalls['fp16']:.4f}; cached history: the tower's part {speedup:.1f}x faster; "
        f"the model's last training loss {loss:.3f} (chance: ln {catalogue:,} = {chance:.3f}), "
        f"validation HR@10 {hr10:.4f}",
        file=sys.stderr,
        flush=True,
    )
    bodies = history_bodies(fp32, 64, args.history, args.k, seed=2)
    server = Server(fp32_dir, "--keep-histories", str(args.history), "--max-batch", "64")
    try:
        # warm-up: every batch shape the load will see, compiled before it is timed
        load(server, bodies, rows=1, clients=args.clients, duration=3.0)
        print(f"== {args.clients} clients, {args.duration:.0f} s", file=sys.stderr, flush=True)
        figures = load(server, bodies, rows=1, clients=args.clients, duration=args.duration)
        cached_ms, full_ms = request_latencies(server, fp32, args.history, args.k, 20, seed=4)
    finally:
        server.stop()
    summary = {
        "catalogue": catalogue,
        "history": args.history,
        "k": args.k,
        "clients": args.clients,
        "p50_ms": figures["p50_ms"],
        "p99_ms": figures["p99_ms"],
        "requests_per_s": figures["rows_per_s"],
        "errors": figures["errors"],
        "recall_at_k_int8": round(recalls["int8"], 4),
        "recall_at_k_fp16": round(recalls["fp16"], 4),
        "cached_speedup": round(speedup, 2),
        "cached_request_p50_ms": round(cached_ms, 2),
        "full_request_p50_ms": round(full_ms, 2),
        "cached_request_speedup": round(full_ms / cached_ms, 2),
        "train_loss": round(loss, 4),
        "loss_at_chance": round(chance, 4),
        "hr_at_10_valid": round(hr10, 4),
    }
    print(
        f"[bench_serve_sequences] {catalogue:,} items, histories of {args.history}, top-"
        f"{args.k}, {args.clients} clients: p50 {summary['p50_ms']} ms, p99 "
        f"{summary['p99_ms']} ms, {summary['requests_per_s']} requests/s, recall int8 "
        f"{summary['recall_at_k_int8']}, fp16 {summary['recall_at_k_fp16']}, cached {summary['cached_speedup']}x (tower), "
        f"{summary['cached_request_speedup']}x (request)",
        file=sys.stderr,
        flush=True,
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
