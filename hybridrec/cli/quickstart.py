"""`hybridrec quickstart`: the whole job on a built-in default, end to end.

generate (synthetic Criteo-format logs) → preprocess (Apache Beam) → train (hybrid
loop, in-process embedding shards, on the devices JAX sees) → evaluate the final
checkpoint → plot → summary. With `--input` it preprocesses real Criteo files
(Kaggle `train.txt`, 1TB `day_N`, `.gz` or not) instead of generating data.

Everything goes under `--out` (default runs/quickstart): `raw/`, `data/`, `run/`.

`--example sequences` runs the same stages for a sequential recommender: a generated
event log of users' actions → the event-log Beam job (user histories) → SASRec → full-
ranking evaluation on the test split → export → a few users' top-5 next items through
`hybridrec serve`, as raw item ids.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import time
from pathlib import Path

from hybridrec.cli import _flags, evaluate, export, generate, plot, preprocess, train
from hybridrec.serving import demo_score, demo_top_k

DEFAULT_ROWS = 1_000_000
SEQUENCE_EXAMPLE = {"users": 6_000, "items": 3_000, "topics": 30, "mean_events": 25}
# the preset as shipped (history length and batch from the data, the best checkpoint kept
# on validation), its 200-epoch cap lowered to 20 to keep the example near a minute
SEQUENCE_RUN = ["data.epochs=20"]


def _last_rows(path: Path, count: int) -> list[str]:
    """The last `count` lines of a (gzipped) text file."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return [line.rstrip("\n") for line in collections.deque(handle, maxlen=count)]


def _stage(title: str) -> float:
    print(f"\n== {title}", flush=True)
    return time.perf_counter()


def main(argv: list[str]) -> int:
    """`hybridrec quickstart`."""
    parser = argparse.ArgumentParser(
        prog="hybridrec quickstart",
        description="generate -> preprocess -> train -> evaluate -> summary on a built-in default",
    )
    parser.add_argument("--out", default="runs/quickstart", help="output directory")
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS, help="synthetic rows to generate")
    parser.add_argument(
        "--input",
        nargs="+",
        help="real Criteo TSV files (.gz allowed) to use instead of synthetic data",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the generator and the run")
    parser.add_argument("--config", default="quickstart", help="training preset")
    parser.add_argument(
        "--example",
        choices=("clicks", "sequences"),
        default="clicks",
        help="clicks: a CTR model on Criteo-format logs; sequences: SASRec on an event log",
    )
    _flags.add_override_flag(parser, "override a training config key (repeatable)")
    args = parser.parse_args(argv)
    return EXAMPLES[args.example](args)


def _clicks(args: argparse.Namespace) -> int:
    """The click-log example: Criteo-format rows -> Beam -> DLRM -> AUC -> serve."""
    out = Path(args.out)
    started = time.perf_counter()
    timings: dict[str, float] = {}
    if args.input:
        inputs = [str(path) for path in args.input]
    else:
        begin = _stage(f"generate {args.rows:,} synthetic Criteo-format rows")
        raw = out / "raw" / "synthetic.tsv.gz"
        raw.parent.mkdir(parents=True, exist_ok=True)
        generate.main(["--output", str(raw), "--rows", str(args.rows), "--seed", str(args.seed)])
        inputs = [str(raw)]
        timings["generate"] = time.perf_counter() - begin

    begin = _stage("preprocess (Apache Beam, DirectRunner)")
    data = out / "data"
    preprocess.main(["--input", *inputs, "--output", str(data), "--overwrite"])
    timings["preprocess"] = time.perf_counter() - begin

    begin = _stage("train (hybrid loop: async embedding store, synchronous dense step on the mesh)")
    run_dir = out / "run"
    overrides = [*args.overrides, f"seed={args.seed}"]
    _train(data, run_dir, args.config, overrides)
    timings["train"] = time.perf_counter() - begin

    begin = _stage("evaluate the final checkpoint")
    evaluate.main(["--run", str(run_dir)])
    timings["evaluate"] = time.perf_counter() - begin
    plot.main([str(run_dir)])

    begin = _stage("export the model and score a few eval rows through `hybridrec serve`")
    exported = out / "export"
    export.main(["--run", str(run_dir), "--out", str(exported), "--precision", "int8"])
    rows = _last_rows(Path(inputs[-1]), 5)  # the last rows: in the eval split (split by position)
    for row, probability in zip(rows, demo_score(exported, rows), strict=True):
        label = row.split("\t", 1)[0]
        print(f"  label {label}  click probability {probability:.4f}")
    timings["export+serve"] = time.perf_counter() - begin

    total = time.perf_counter() - started
    stages = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in timings.items())
    print(
        f"\nquickstart finished in {total:.0f} s ({stages})\n"
        f"  data      {data}  (metadata.json, train/ and eval/ Parquet)\n"
        f"  run       {run_dir}  (summary.json, metrics.jsonl, tensorboard/, checkpoints/)\n"
        f"  curves    {run_dir / 'plots' / 'curves.png'}\n"
        f"  export    {exported}  (serve it: hybridrec serve {exported})\n"
        f"  next      tensorboard --logdir {run_dir / 'tensorboard'}   |   "
        f"hybridrec train --config criteo_dlrm --data DIR --run-dir runs/criteo",
        flush=True,
    )
    return 0


def _train(data: Path, run_dir: Path, config: str, overrides: list[str]) -> None:
    sets = [item for override in overrides for item in ("--set", override)]
    train.main(
        ["--data", str(data), "--run-dir", str(run_dir), "--config", config, "--overwrite", *sets]
    )


def _histories_of(events: Path, users: int) -> dict[str, list[tuple[int, str, str, str]]]:
    """The first `users` users of a generated event log and their (time, item, action,
    device) events, oldest first."""
    import pyarrow.csv as csv

    table = csv.read_csv(events).to_pydict()
    out: dict[str, list[tuple[int, str, str, str]]] = {}
    columns = (table[name] for name in ("user_id", "item_id", "timestamp", "action", "device"))
    for user, item, when, action, device in zip(*columns, strict=True):
        if user in out or len(out) < users:
            out.setdefault(user, []).append((when, item, action, device))
    return {user: sorted(events) for user, events in out.items()}


def _sequences(args: argparse.Namespace) -> int:
    """`hybridrec quickstart --example sequences`."""
    out = Path(args.out if args.out != "runs/quickstart" else "runs/quickstart-sequences")
    started = time.perf_counter()
    timings: dict[str, float] = {}
    size = SEQUENCE_EXAMPLE
    begin = _stage(f"generate an event log of {size['users']:,} users over {size['items']:,} items")
    raw = out / "raw"
    generate.main(
        ["--events", "--output", str(raw), "--seed", str(args.seed)]
        + [f"--{key.replace('_', '-')}={value}" for key, value in size.items()]
    )
    timings["generate"] = time.perf_counter() - begin

    begin = _stage("preprocess (Apache Beam: events grouped into user histories, leave-one-out)")
    data = out / "data"
    preprocess.main(
        ["--input", str(raw / "events.csv"), "--spec", str(raw / "events.toml")]
        + ["--output", str(data), "--overwrite"]
    )
    timings["preprocess"] = time.perf_counter() - begin

    begin = _stage("train SASRec (packed histories, item rows from the embedding store)")
    run_dir = out / "run"
    config = args.config if args.config != "quickstart" else "sasrec"
    _train(data, run_dir, config, [*SEQUENCE_RUN, *args.overrides, f"seed={args.seed}"])
    timings["train"] = time.perf_counter() - begin

    begin = _stage("evaluate the best checkpoint on the test split (full ranking of every item)")
    evaluate.main(["--run", str(run_dir), "--split", "test"])
    timings["evaluate"] = time.perf_counter() - begin

    begin = _stage("export, and a few users' next items through `hybridrec serve`")
    exported = out / "export"
    export.main(["--run", str(run_dir), "--out", str(exported)])
    histories = _histories_of(raw / "events.csv", 3)
    events = list(histories.values())
    sides = json.loads((run_dir / "config.json").read_text())["model"]["sequence"]
    answers = demo_top_k(
        exported,
        [[item for _, item, _, _ in history] for history in events],
        k=5,
        times=[[when for when, _, _, _ in history] for history in events],
        actions=[[action for _, _, action, _ in history] for history in events],
        # the generated log's event feature, for a run that reads it
        sides={"device": [[d for *_, d in history] for history in events]}
        if "device" in sides["side_features"]
        else None,  # fmt: skip
    )
    for (user, history), top in zip(histories.items(), answers, strict=True):
        recent = " ".join(f"{item} ({action})" for _, item, action, _ in history[-5:])
        items = ", ".join(f"{item} ({score:.2f})" for item, score in top)
        print(f"  {user}: last items {recent}\n      top-5 next: {items}")
    timings["export+serve"] = time.perf_counter() - begin

    total = time.perf_counter() - started
    stages = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in timings.items())
    print(
        f"\nquickstart (sequences) finished in {total:.0f} s ({stages})\n"
        f"  data      {data}  (metadata.json, train/ valid/ test/ histories, items/)\n"
        f"  run       {run_dir}  (summary.json, metrics.jsonl, checkpoints/)\n"
        f"  export    {exported}  (serve it: hybridrec serve {exported} --keep-histories 200)",
        flush=True,
    )
    return 0


EXAMPLES = {"clicks": _clicks, "sequences": _sequences}  # --example -> what it runs
