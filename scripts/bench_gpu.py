"""Training speed on an accelerator: the hybrid loop against its own dense step, for the
`criteo_dlrm` shape and the MLPerf DLRM shape. Meant for a GPU; runs on any JAX platform
(JAX_PLATFORMS or --platform picks it).

In one run:
- **data**: `hybridrec generate` rows with Criteo's skew and the long tail widened
  (--rows, default 10M; --cardinality-scale 10: ~10M distinct ids over the long-tail
  features), preprocessed once by `hybridrec preprocess` with 1% held out for evaluation
  (--eval-fraction); both are cached under --cache, keyed by rows, seed and scale;
- **per shape and batch**: the dense step alone (the same jitted step with the batches
  already on the devices, in a process of its own), and `hybridrec train` for --samples
  samples at staleness 4 and 0 (--staleness), each in a fresh process, with the default
  placement (the planner puts on the devices what fits its budget); --host-only adds a run
  with every table in the host store (embedding.device_budget = 0);
- **per run**: steady samples/s (after the first 20 steps), where the trainer thread's time
  goes per step (waiting for the batch's lookups, dispatching the step, waiting for the
  devices, handing the gradients over), XLA compile seconds inside the steady window (a
  new batch shape compiles the step: device tables' padded sizes while they fill), the
  host CPU it kept busy (cores, on average), device memory at its peak (where the backend
  reports it), eval AUC; with --profile, a `jax.profiler` trace of the staleness-4 run's
  last 10 steps (`log.profile_from`; after the steady window and the per-stage times,
  inside the end-to-end rate), summed up as each thread's busy time per step, the time
  something ran on the device and the top operations.

Measurements accumulate per device kind in --cache (results.jsonl): a matrix too long for
one invocation runs in parts (--shapes, --batches, --staleness), and each invocation prints
everything measured so far on this kind of device (--fresh starts over).

    python scripts/bench_gpu.py                                   # the whole matrix
    python scripts/bench_gpu.py --shapes mlperf --batches 16384   # one part of it
    python scripts/bench_gpu.py --rows 200000 --batches 2048 --samples 120000   # a small run

The last line is one JSON object: platform, device_kind, devices, rows,
distinct_ids_long_tail; per shape and batch B (criteo_dlrm; the MLPerf shape's keys start
with "mlperf_"): dense_only_samples_per_s_bB, hybrid_samples_per_s_bB (staleness 4),
hybrid_sync_samples_per_s_bB (staleness 0), hybrid_host_samples_per_s_bB (--host-only),
hybrid_over_dense_bB, auc_bB, host_cores_bB, device_peak_gb_bB, wait_ms_bB, device_ms_bB,
device_lookup_fraction_bB (the lookups the devices' tables served), ids_in_step_bB
(whether the step mapped the device tables' ids: `embedding.map_ids`, "auto" on a GPU),
steady_compile_s_bB; with --profile, device_busy_ms_bB (the time something ran on the
busiest device, where the trace shows the device);
and mlperf_shape_samples_per_s, the MLPerf shape's best hybrid rate over the batches
measured (mlperf_shape_batch says which).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench_criteo import REPO, _compilation_cache, _dataset, _dense_only, _fail, _train
from hybridrec.pipeline.synthetic import CATEGORICAL_PROFILE, LONG_TAIL
from hybridrec.training.profiling import format_summary

# shape -> its overrides of the criteo_dlrm preset
SHAPES = {
    "criteo_dlrm": (),
    # MLPerf DLRM (Criteo 1TB): embedding dim 128, bottom MLP 13-512-256-128, top MLP
    # 1024-1024-512-256-1 (the tower adds the output layer)
    "mlperf": (
        "embedding.dim=128",
        "model.dlrm.bottom_mlp=[512, 256, 128]",
        "model.dlrm.top_mlp=[1024, 1024, 512, 256]",
    ),
}
PREFIX = {"criteo_dlrm": "", "mlperf": "mlperf_"}
MIN_STEPS = 50  # a run's steps at the least: 20 of warm-up, the rest steady
PROFILED_STEPS = 10  # --profile: the run's last steps (its last log interval) are traced
PROBE = (
    "import json, jax; d = jax.devices(); "
    "print(json.dumps({'platform': d[0].platform, 'device_kind': d[0].device_kind, "
    "'devices': len(d)}))"
)


def _probe(env: dict) -> dict:
    """The platform, device kind and device count JAX finds with `env` (in a child, so
    that this process never holds a device); one line and exit 2 if it finds none."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, cwd=REPO
    )
    if out.returncode:
        lines = out.stderr.strip().splitlines() or ["no output"]
        asked = env.get("JAX_PLATFORMS")
        _fail(
            f"JAX cannot start {'platform ' + repr(asked) if asked else 'a backend'} here: "
            f"{lines[-1]}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _raw_data(cache: Path, rows: int, seed: int, scale: float) -> Path:
    """Generated Criteo-format rows, from the cache or written into it atomically."""
    raw = cache / f"raw-{rows}-seed{seed}-scale{scale:g}.tsv"
    if raw.exists():
        print(f"generated data: {raw} (cached)", flush=True)
        return raw
    cache.mkdir(parents=True, exist_ok=True)
    partial = raw.with_suffix(".partial")
    command = [sys.executable, "-m", "hybridrec", "generate", "--output", str(partial)]
    command += ["--rows", str(rows), "--seed", str(seed), "--cardinality-scale", str(scale)]
    if subprocess.run(command, cwd=REPO).returncode:
        partial.unlink(missing_ok=True)
        _fail("generating the data failed (nothing was cached)")
    partial.rename(raw)
    return raw


def _distinct_ids(data: Path) -> tuple[int, int]:
    """(distinct ids over every feature, over the generator's long-tail features: C3, C4,
    C12, C16, C21, C24, C26) of the train split, as the preprocessing counted them."""
    features = json.loads((data / "metadata.json").read_text())["stats"]["categorical"]
    long_tail = {
        f"C{j + 1}" for j, (card, _, _) in enumerate(CATEGORICAL_PROFILE) if card >= LONG_TAIL
    }
    counts = {name: int(f["distinct_estimate"]) for name, f in features.items()}
    return sum(counts.values()), sum(counts[name] for name in long_tail)


class Results:
    """Measurements of one device kind and dataset, kept across invocations."""

    def __init__(self, path: Path, key: dict, fresh: bool):
        self.path, self.key = path, key
        if fresh:
            path.unlink(missing_ok=True)
        self.rows: dict[tuple, dict] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                record = json.loads(line)
                if all(record.get(k) == v for k, v in key.items()):
                    self.rows[self._id(record)] = record  # a later measurement wins

    @staticmethod
    def _id(record: dict) -> tuple:
        return record["shape"], record["batch"], record["run"]

    def add(self, record: dict) -> None:
        record = {**self.key, **record}
        self.rows[self._id(record)] = record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def get(self, shape: str, batch: int, run: str) -> dict | None:
        return self.rows.get((shape, batch, run))


def _hybrid(data, shape, batch, staleness, args, work, env, extra=(), tag=""):
    steps = max(MIN_STEPS, args.samples // batch)
    extra = list(extra)
    if args.profile and staleness == 4 and not tag:
        # the steady rate is read up to the last log record but one (bench_criteo._train,
        # a record every 10 steps): the trace of the last 10 steps stays out of it
        steps = -(-steps // PROFILED_STEPS) * PROFILED_STEPS
        first = steps - PROFILED_STEPS + 1
        extra += [f"log.profile_from={first}", f"log.profile_steps={PROFILED_STEPS}"]
    settings = [*SHAPES[shape], f"data.max_steps={steps}", *extra, *args.extra]
    result = _train(data, batch, staleness, work, env, settings, tag=f"_{shape}{tag}")
    peak = result["device_peak_bytes"]
    profile = result.get("profile")
    if profile:
        profile = {**profile, "top": profile["top"][:12]}
    return {
        "samples_per_s": round(result["steady_samples_per_s"]),
        "e2e_samples_per_s": round(result["e2e_samples_per_s"]),
        "auc": round(result["auc"], 4),
        "host_cores": round(result["host_cores"], 2),
        "device_peak_gb": None if peak is None else round(peak / 2**30, 2),
        "peak_rss_gb": round(result["peak_rss_gb"], 2),
        "device_lookup_fraction": result["device_lookup_fraction"],
        "ids_in_step": result["ids_in_step"],
        "steady_compile_s": result["steady_compile_s"],
        **{name: result[name] for name in ("wait_ms", "step_ms", "device_ms", "update_ms")},
        "profile": profile,
    }


def _measure(data: Path, args, results: Results, env: dict) -> None:
    work = args.cache / "runs"
    runs = {f"k{k}": (k, ()) for k in args.staleness}
    if args.host_only:
        runs["host"] = (4, ("embedding.device_budget=0",))
    for shape in args.shapes:
        for batch in args.batches:
            rate = _dense_only(batch, env, args.rounds, SHAPES[shape] + tuple(args.extra))
            results.add({"shape": shape, "batch": batch, "run": "dense", "samples_per_s": rate})
            for run, (staleness, extra) in runs.items():
                tag = "_host" if run == "host" else ""
                measured = _hybrid(data, shape, batch, staleness, args, work, env, extra, tag)
                results.add({"shape": shape, "batch": batch, "run": run, **measured})


def _rate(record: dict | None) -> str:
    return f"{record['samples_per_s']:,.0f}" if record else "-"


def _report(results: Results, info: dict, distinct: tuple[int, int]) -> dict:
    """Prints the table of everything measured on this device kind; returns the JSON."""
    summary = {**info, "distinct_ids": distinct[0], "distinct_ids_long_tail": distinct[1]}
    print(
        "\n| shape | batch | dense-only | hybrid k=4 | k=0 | host store only | hybrid/dense "
        "| AUC | wait/step/device/update ms | compile s | host cores | device peak GB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    best, profiles = None, []
    shapes = sorted({s for s, _, _ in results.rows}, key=list(SHAPES).index)
    for shape in shapes:
        prefix = PREFIX[shape]
        for batch in sorted({b for s, b, _ in results.rows if s == shape}):
            dense, hybrid = results.get(shape, batch, "dense"), results.get(shape, batch, "k4")
            sync, host = results.get(shape, batch, "k0"), results.get(shape, batch, "host")
            keyed = {
                "dense_only_samples_per_s": dense and round(dense["samples_per_s"]),
                "hybrid_samples_per_s": hybrid and hybrid["samples_per_s"],
                "hybrid_sync_samples_per_s": sync and sync["samples_per_s"],
                "hybrid_host_samples_per_s": host and host["samples_per_s"],
            }
            main = hybrid or sync
            if dense and main:
                keyed["hybrid_over_dense"] = round(
                    main["samples_per_s"] / dense["samples_per_s"], 3
                )
            if main:
                for name in (
                    "auc", "host_cores", "device_peak_gb", "wait_ms", "device_ms",
                    "device_lookup_fraction",
                ):  # fmt: skip
                    keyed[name] = main[name]
                keyed["ids_in_step"] = main.get("ids_in_step")
                keyed["steady_compile_s"] = main.get("steady_compile_s")
            if hybrid and hybrid.get("profile"):  # printed below the table
                profiles.append((f"{shape}, batch {batch}, k4", hybrid["profile"]))
                busy = hybrid["profile"].get("device_busy_ms_per_step", {}).values()
                keyed["device_busy_ms"] = max(busy, default=None)
            summary.update({f"{prefix}{k}_b{batch}": v for k, v in keyed.items() if v is not None})
            if shape == "mlperf" and hybrid and (best is None or hybrid["samples_per_s"] > best[0]):
                best = (hybrid["samples_per_s"], batch)
            phases = (
                "/".join(f"{main[n]:.1f}" for n in ("wait_ms", "step_ms", "device_ms", "update_ms"))
                if main
                else "-"
            )
            print(
                f"| {shape} | {batch} | {_rate(dense)} | {_rate(hybrid)} | {_rate(sync)} | "
                f"{_rate(host)} | {keyed.get('hybrid_over_dense', '-')} | "
                f"{main['auc'] if main else '-'} | {phases} | "
                f"{(main or {}).get('steady_compile_s', '-')} | "
                f"{main['host_cores'] if main else '-'} | "
                f"{(main and main['device_peak_gb']) or '-'} |"
            )
    if best:
        summary["mlperf_shape_samples_per_s"], summary["mlperf_shape_batch"] = best
    for run, profile in profiles:
        print(f"\nwhere the time went: {run}")
        print("\n".join(format_summary(profile, limit=12)))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000, help="generated rows")
    parser.add_argument("--cardinality-scale", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0, help="of the generated data")
    parser.add_argument("--eval-fraction", type=float, default=0.01, help="rows held out")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--staleness", type=int, nargs="+", default=[4, 0], choices=[4, 0])
    parser.add_argument("--samples", type=int, default=5_000_000, help="per training run")
    parser.add_argument("--host-only", action="store_true", help="also every table on the host")
    parser.add_argument("--rounds", type=int, default=5, help="dense-only timing rounds")
    parser.add_argument("--platform", help="JAX_PLATFORMS of the runs (default: JAX's choice)")
    parser.add_argument("--cache", type=Path, default=REPO / "runs" / "bench_gpu")
    parser.add_argument("--fresh", action="store_true", help="forget earlier measurements")
    parser.add_argument(
        "--profile", action="store_true", help="trace the last steps of the staleness-4 runs"
    )
    parser.add_argument("--set", dest="extra", action="append", default=[], help="train override")
    args = parser.parse_args()
    if args.rows < 1000:
        _fail(f"--rows {args.rows}: at least 1000 rows are needed")
    env = dict(os.environ)
    if args.platform:
        env["JAX_PLATFORMS"] = args.platform
    if args.profile and 4 not in args.staleness:
        _fail("--profile traces the staleness-4 runs: keep 4 in --staleness")
    info = _probe(env)
    for batch in args.batches:
        if batch % info["devices"]:
            _fail(f"--batches {batch}: does not divide over the {info['devices']} devices")
    print(f"devices: {info['devices']} x {info['device_kind']} ({info['platform']})", flush=True)
    # a compilation cache of this invocation: each shape's first run compiles
    env["HYBRIDREC_COMPILATION_CACHE"] = _compilation_cache("bench-gpu")
    raw = _raw_data(args.cache, args.rows, args.seed, args.cardinality_scale)
    data = _dataset([raw], args.cache, ("--eval-fraction", str(args.eval_fraction)))
    distinct = _distinct_ids(data)
    key = {**info, "rows": args.rows, "seed": args.seed, "scale": args.cardinality_scale}
    key["eval_fraction"] = args.eval_fraction
    results = Results(args.cache / "results.jsonl", key, args.fresh)
    _measure(data, args, results, env)
    summary = _report(results, {**info, "rows": args.rows}, distinct)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
