"""Training speed, memory and quality on Criteo data, against the dense step's own limit.

In one run: preprocess the input once (cached under --cache, keyed by the input files),
then train one epoch of the `criteo_dlrm` preset at batch 128, 512 and 4096, each in a
fresh `hybridrec train` process, and the synchronous mode (staleness 0) at batch 512;
at batch 512 both modes run for every `--seeds` seed and the means count (with k > 0
the interleaving of lookups and updates depends on timing, so one run's AUC is noisy).
Per run it reports end-to-end samples/s (process start to final checkpoint: imports,
compilation, evaluation and checkpoint included), steady-state samples/s (after the
first 20 steps), where a step's time goes on the trainer's thread, the slowest step
after those (table growth must not stall training),
eval AUC and the peak resident memory of the process; and the dense-only limit: the
same jitted step on the same tower, batch and devices with the batches already on the
devices, in its own process.

    python scripts/bench_criteo.py                      # the shared Criteo sample
    python scripts/bench_criteo.py --input day_0.gz     # any Criteo-format files

The last line is one JSON object (keys: auc_b512, auc_sync_b512, steady_over_dense_b128,
steady_over_dense_b512, steady_over_dense_b4096, e2e_over_dense_b512,
steady_samples_per_s_b512, e2e_samples_per_s_b512, hybrid_over_sync_b512, peak_rss_gb,
steady_samples_per_s_b512_host, steady_samples_per_s_b512_device, device_over_host_b512,
device_lookup_fraction_b512 (lookups served by tables on the devices), auc_b512_host;
with --cache-budget (a budget that leaves the big tables on the host, each with a hot-row
cache on the devices): steady_samples_per_s_b512_cached, cached_over_host_b512,
cache_hit_rate_b512 (of the cached tables' lookups, the share their caches held),
auc_b512_cached;
with --server (the same batch-512 run against one `hybridrec serve-embeddings` process of
2 shards on loopback, a fresh one per run): steady_samples_per_s_b512_server (every table
on the server), steady_samples_per_s_b512_server_device (the default budget),
steady_samples_per_s_b512_server_cached (--cache-budget), server_device_over_server_b512,
server_cached_over_server_b512, cache_hit_rate_b512_server;
the e2e keys are of the first batch-512 run, which compiles: the run has a compilation
cache of its own, so later seeds' runs load the programs instead, reported as
e2e_warm_over_dense_b512 and e2e_warm_samples_per_s_b512).
"""

from __future__ import annotations

import argparse
import atexit
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO.parent / "shared" / "data" / "criteo_kaggle_sample" / "train.tsv.gz"
CRITEO_FIELDS = 40  # label, 13 integer and 26 categorical fields
STEADY_AFTER = 20  # steps excluded from the steady state (compilation, warm-up)


def _fail(message: str) -> None:
    """One line naming the running benchmark (this module is shared by several), exit 2."""
    print(f"{Path(sys.argv[0]).stem}: error: {message}", file=sys.stderr)
    sys.exit(2)


def _check_criteo(path: Path) -> None:
    """One-line error unless `path` exists and its first line has the Criteo layout."""
    if not path.is_file():
        _fail(f"{path}: no such file")
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", errors="replace") as handle:
            line = handle.readline().rstrip("\n")
    except (OSError, EOFError) as error:
        _fail(f"{path}: unreadable ({error})")
    fields = line.split("\t")
    if len(fields) != CRITEO_FIELDS or fields[0] not in ("0", "1"):
        _fail(
            f"{path}: line 1 is not in the Criteo layout (expected {CRITEO_FIELDS} tab-separated "
            f"fields starting with a 0/1 label, found {len(fields)})"
        )


def checked_inputs(given: list[Path] | None) -> list[Path]:
    """The Criteo-format files to run on: `given`, else the shared sample; a one-line error
    when the sample is absent or a file is not in the Criteo layout."""
    if not given and not SAMPLE.exists():
        _fail(f"{SAMPLE} is absent: pass --input FILE... (Criteo-format files)")
    inputs = given or [SAMPLE]
    for path in inputs:
        _check_criteo(path)
    return inputs


def _compilation_cache(name: str) -> str:
    """A fresh JAX compilation cache for this invocation, removed at exit (also a failed one)."""
    directory = tempfile.mkdtemp(prefix=f"{name}-jax-cache-")
    atexit.register(shutil.rmtree, directory, True)
    return directory


def _dataset(inputs: list[Path], cache: Path, options: tuple[str, ...] = ()) -> Path:
    """The preprocessed dataset of `inputs` (with `preprocess` `options`), from the cache or
    written into it atomically."""
    key = hashlib.sha256()
    for path in inputs:
        stat = path.stat()
        key.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    if options:
        key.update("\0".join(options).encode())
    target = cache / f"data-{key.hexdigest()[:16]}"
    if (target / "_SUCCESS").exists():
        print(f"preprocessed data: {target} (cached)", flush=True)
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="partial-", dir=cache))
    try:
        command = [sys.executable, "-m", "hybridrec", "preprocess", "--input"]
        command += [str(path) for path in inputs] + ["--output", str(staging), "--overwrite"]
        command += list(options)
        subprocess.run(command, check=True, cwd=REPO)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except (subprocess.CalledProcessError, KeyboardInterrupt):
        shutil.rmtree(staging, ignore_errors=True)
        _fail(f"preprocessing {', '.join(map(str, inputs))} failed (nothing was cached)")
    return target


def _run_child(command: list[str], env: dict[str, str]) -> tuple[float, float, int, float]:
    """Runs `command`; returns (wall seconds, peak RSS in GB, exit code, CPU seconds)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=env)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    cpu = usage.ru_utime + usage.ru_stime
    return time.perf_counter() - start, usage.ru_maxrss / 2**20, process.returncode, cpu


def _train(
    data: Path,
    batch: int,
    staleness: int,
    work: Path,
    env: dict,
    extra: list[str],
    seed: int = 0,
    tag: str = "",
    preset: str | None = "criteo_dlrm",
):
    """One `hybridrec train` run of `preset` (None: no preset, the "auto" defaults) in a
    fresh process; its speeds, eval metrics and peak memory."""
    run_dir = work / f"run_b{batch}_k{staleness}_seed{seed}{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "hybridrec", "train"]
    command += ["--config", preset] if preset else []
    command += ["--data", str(data), "--run-dir", str(run_dir), "--quiet"]
    settings = [
        f"data.batch_size={batch}",
        f"hybrid.staleness={staleness}",
        f"seed={seed}",
        "log.every_steps=10",
        "log.tensorboard=false",
        *extra,
    ]
    for setting in settings:
        command += ["--set", setting]
    print(f"\n== train batch {batch}, staleness {staleness}, seed {seed}{tag}", flush=True)
    seconds, rss_gb, code, cpu_seconds = _run_child(command, env)
    if code:
        _fail(f"training at batch {batch} failed (exit {code}); see the output above")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    train = [r for r in records if r["kind"] == "train"]
    first = next((r for r in train if r["step"] >= STEADY_AFTER), train[0])
    # the last record holds the end's drain and write-back, which are not steady training
    last = train[-2] if len(train) > 2 and train[-2]["step"] > first["step"] else train[-1]
    # the same window as the steady rate's (a trace of the last steps stays out of it)
    steady_steps = [r for r in train if first["step"] < r["step"] <= last["step"]]
    done = "samples_done" if "samples_done" in last else "samples"  # trained, not dispatched
    if last["step"] > first["step"]:
        steady = (last[done] - first[done]) / (last["time"] - first["time"])
    else:
        steady = last["samples_per_s"]
    phases = {}
    for name in ("wait_ms", "step_ms", "device_ms", "update_ms"):
        values = [r[name] for r in steady_steps if name in r] or [0.0]
        phases[name] = round(sum(values) / len(values), 2)
    result = {
        "batch": batch,
        "staleness": staleness,
        "steps": summary["steps"],
        "e2e_samples_per_s": summary["samples"] / seconds,
        "steady_samples_per_s": steady,
        "auc": summary["eval"]["auc"],
        "logloss": summary["eval"]["logloss"],
        "peak_rss_gb": rss_gb,
        "host_cores": cpu_seconds / seconds,  # host CPU busy on average over the process
        # the devices' peak memory (None where the backend reports none, as on CPU)
        "device_peak_bytes": (summary.get("device_memory") or {}).get("peak_bytes_per_device"),
        # after the warm-up: the first steps hold compilation, later ones table growth
        "slowest_step_ms": max(
            (r.get("slowest_step_ms", 0.0) for r in steady_steps), default=float("nan")
        ),
        "store_bytes": summary["embedding_store"].get("bytes"),
        # the share of embedding lookups served by tables on the devices
        "device_lookup_fraction": _device_fraction(summary),
        # of the cached tables' lookups, the share their hot-row caches held (None: none)
        "cache_hit_rate": (summary.get("device_tables") or {}).get("cache_hit_rate"),
        # whether the step mapped the device tables' ids (embedding.map_ids), not the host
        "ids_in_step": bool((summary.get("device_tables") or {}).get("mapped_on_devices")),
        # XLA compile seconds inside the steady window (a new batch shape compiles the step)
        "steady_compile_s": round(last.get("compile_s", 0.0) - first.get("compile_s", 0.0), 2),
        "compiles": summary.get("compiles"),
        "profile": summary.get("profile"),  # log.profile_from: where the traced steps went
        **phases,
    }
    print(
        f"   e2e {result['e2e_samples_per_s']:,.0f} samples/s ({seconds:.1f} s), steady "
        f"{steady:,.0f} samples/s, AUC {result['auc']:.4f}, peak RSS {rss_gb:.2f} GB, per step: "
        f"wait {phases['wait_ms']} ms, step {phases['step_ms']} ms, device "
        f"{phases['device_ms']} ms, update "
        f"{phases['update_ms']} ms, slowest {result['slowest_step_ms']:.0f} ms",
        flush=True,
    )
    return result


def _against_a_server(data: Path, work: Path, env: dict, extra: list[str], cache_budget: int):
    """Batch 512, staleness 4, one trainer in front of a fresh server process per run:
    every table on the server, the default budget's device tables, and `cache_budget`."""
    from hybridrec.cli.server_processes import start_servers, stop_servers

    runs = {"server": ["embedding.device_budget=0"], "server_device": []}
    if cache_budget:
        runs["server_cached"] = [f"embedding.device_budget={cache_budget}"]
    results = {}
    for tag, keys in runs.items():
        servers = start_servers(
            1,
            num_shards=2,
            config="criteo_dlrm",
            data=data,
            overrides=["data.batch_size=512", *extra],
            log_dir=work,
        )
        served = dict(env, HYBRIDREC_EMBEDDING_SERVERS=servers[0].address)
        try:
            results[tag] = _train(data, 512, 4, work, served, [*extra, *keys], tag=f"_{tag}")
        finally:
            stop_servers(servers)
    base = results["server"]["steady_samples_per_s"]
    out = {
        f"steady_samples_per_s_b512_{tag}": round(r["steady_samples_per_s"])
        for tag, r in results.items()
    }
    for tag in ("server_device", "server_cached"):
        if tag in results:
            out[f"{tag}_over_server_b512"] = round(results[tag]["steady_samples_per_s"] / base, 3)
    if "server_cached" in results:
        out["cache_hit_rate_b512_server"] = results["server_cached"]["cache_hit_rate"]
    print(
        "batch 512, staleness 4, one embedding server: steady "
        + ", ".join(f"{tag} {r['steady_samples_per_s']:,.0f}" for tag, r in results.items())
        + " samples/s"
    )
    return out


def _device_fraction(summary: dict) -> float:
    on_devices = (summary.get("device_tables") or {}).get("lookups", 0)
    on_host = summary["embedding_store"].get("lookups", 0)
    return round(on_devices / max(on_devices + on_host, 1), 4)


def _mean_run(runs: list[dict]) -> dict:
    """Numeric fields averaged over runs of different seeds (AUCs listed per seed too)."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float):
            out[key] = sum(run[key] for run in runs) / len(runs)
    out["peak_rss_gb"] = max(run["peak_rss_gb"] for run in runs)
    out["slowest_step_ms"] = max(run["slowest_step_ms"] for run in runs)
    out["auc_per_seed"] = [round(run["auc"], 4) for run in runs]
    # the first run compiles (a cold compilation cache), later seeds load the same programs
    out["e2e_samples_per_s"] = runs[0]["e2e_samples_per_s"]
    warm = [run["e2e_samples_per_s"] for run in runs[1:]]
    out["e2e_warm_samples_per_s"] = sum(warm) / len(warm) if warm else None
    return out


def _dense_only(batch: int, env: dict, rounds: int, overrides: tuple[str, ...] = ()) -> float:
    """Samples/s of the criteo_dlrm train step alone (batches on the devices), median round;
    `overrides` change the preset (another shape)."""
    command = [sys.executable, __file__, "--dense-child", str(batch), "--rounds", str(rounds)]
    for setting in overrides:
        command += ["--set", setting]
    out = subprocess.run(
        command,
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    rate = json.loads(out.stdout.strip().splitlines()[-1])["samples_per_s"]
    print(f"== dense step alone, batch {batch}: {rate:,.0f} samples/s", flush=True)
    return rate


def _dense_child(batch: int, rounds: int, overrides: list[str]) -> None:
    import jax
    import numpy as np
    from hybridrec.common import config as config_lib
    from hybridrec.model import create_train_state, make_global_batch, make_mesh, make_train_step
    from hybridrec.training.config import PRESET_DIR, TrainConfig

    config = config_lib.load(TrainConfig, "criteo_dlrm", overrides, preset_dir=PRESET_DIR)
    mesh = make_mesh(config.mesh)
    state = create_train_state(
        config.model,
        config.optimizer,
        mesh,
        jax.random.key(0),
        num_dense=13,
        num_features=26,
        embedding_dim=config.embedding.dim,
    )
    step = make_train_step(mesh)
    rng = np.random.default_rng(0)
    batches = [
        make_global_batch(
            {
                "embeddings": 0.01
                * rng.standard_normal((batch, 26, config.embedding.dim), np.float32),
                "dense": rng.random((batch, 13)).astype(np.float32),
                "labels": (rng.random(batch) < 0.25).astype(np.float32),
            },
            mesh,
        )
        for _ in range(2)
    ]
    for index in range(5):
        state, metrics, grads = step(state, batches[index % 2])
    jax.block_until_ready((state, metrics, grads))
    start = time.perf_counter()
    for index in range(10):
        state, metrics, grads = step(state, batches[index % 2])
    jax.block_until_ready((state, metrics, grads))
    # rounds of at least ~0.5 s, whatever the device's speed
    steps = max(10, int(0.5 / ((time.perf_counter() - start) / 10)))
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        for index in range(steps):
            state, metrics, grads = step(state, batches[index % 2])
        jax.block_until_ready((state, metrics, grads))
        rates.append(batch * steps / (time.perf_counter() - start))
    print(json.dumps({"samples_per_s": float(np.median(rates))}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", type=Path, help="Criteo-format files")
    parser.add_argument("--cache", type=Path, default=REPO / "runs" / "bench_criteo")
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 512, 4096])
    parser.add_argument("--rounds", type=int, default=5, help="dense-only timing rounds")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1], help="seeds of the batch-512 runs"
    )
    parser.add_argument(
        "--cache-budget",
        type=int,
        default=8 << 20,
        help="embedding.device_budget of the run with hot-row caches (bytes; 0: no such run)",
    )
    parser.add_argument(
        "--server",
        action="store_true",
        help="also train batch 512 against an embedding server process (3 placements)",
    )
    parser.add_argument("--set", dest="extra", action="append", default=[], help="train override")
    parser.add_argument("--dense-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dense_child:
        _dense_child(args.dense_child, args.rounds, args.extra)
        return
    inputs = checked_inputs(args.input)
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the trainer's own device layout (1 CPU device here)
    # each shape's first run compiles (cold), as a user's first run does; the batch-512
    # runs of later seeds find the programs (warm)
    env["HYBRIDREC_COMPILATION_CACHE"] = _compilation_cache("bench-criteo")
    data = _dataset(inputs, args.cache)
    work = args.cache / "runs"
    results, dense = {}, {}
    for batch in args.batches:
        dense[batch] = _dense_only(batch, env, args.rounds)
        results[batch] = _train(data, batch, 4, work, env, args.extra)
    sync = None
    if 512 in args.batches:  # hybrid vs synchronous: every seed, the mean counts
        sync = _train(data, 512, 0, work, env, args.extra)
        hybrid_runs, sync_runs = [results[512]], [sync]
        for seed in args.seeds[1:]:
            hybrid_runs.append(_train(data, 512, 4, work, env, args.extra, seed))
            sync_runs.append(_train(data, 512, 0, work, env, args.extra, seed))
        results[512], sync = _mean_run(hybrid_runs), _mean_run(sync_runs)
    host = None
    if 512 in args.batches:  # every table in the host store, as before device tables
        host = _train(
            data, 512, 4, work, env, [*args.extra, "embedding.device_budget=0"], tag="_host"
        )
    cached = None
    if 512 in args.batches and args.cache_budget:  # a budget that leaves the big tables
        # on the host, each with a hot-row cache on the devices
        budget = f"embedding.device_budget={args.cache_budget}"
        cached = _train(data, 512, 4, work, env, [*args.extra, budget], tag="_cached")

    print(
        "\n| batch | e2e samples/s | steady samples/s | dense-only | steady/dense | e2e/dense "
        "| AUC | peak RSS GB | wait/step/device/update ms | slowest step ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for batch, r in [*results.items(), *([("512 sync", sync)] if sync else [])]:
        limit = dense[int(str(batch).split()[0])]
        print(
            f"| {batch} | {r['e2e_samples_per_s']:,.0f} | {r['steady_samples_per_s']:,.0f} | "
            f"{limit:,.0f} | {r['steady_samples_per_s'] / limit:.2f} | "
            f"{r['e2e_samples_per_s'] / limit:.2f} | {r['auc']:.4f} | {r['peak_rss_gb']:.2f} | "
            f"{r['wait_ms']:.1f}/{r['step_ms']:.1f}/{r['device_ms']:.1f}/{r['update_ms']:.1f} | "
            f"{r['slowest_step_ms']:.0f} |"
        )
    summary = {
        f"steady_over_dense_b{b}": round(results[b]["steady_samples_per_s"] / dense[b], 3)
        for b in args.batches
    }
    summary["peak_rss_gb"] = round(max(r["peak_rss_gb"] for r in results.values()), 3)
    summary["slowest_step_ms"] = round(max(r["slowest_step_ms"] for r in results.values()), 1)
    if 512 in results:
        b512 = results[512]
        summary.update(
            auc_b512=round(b512["auc"], 4),
            e2e_over_dense_b512=round(b512["e2e_samples_per_s"] / dense[512], 3),
            steady_samples_per_s_b512=round(b512["steady_samples_per_s"]),
            e2e_samples_per_s_b512=round(b512["e2e_samples_per_s"]),
        )
        if b512.get("e2e_warm_samples_per_s"):
            summary.update(
                e2e_warm_over_dense_b512=round(b512["e2e_warm_samples_per_s"] / dense[512], 3),
                e2e_warm_samples_per_s_b512=round(b512["e2e_warm_samples_per_s"]),
            )
    if host:
        device = results[512]
        print(
            f"batch 512, staleness 4: steady {device['steady_samples_per_s']:,.0f} samples/s with "
            f"the planned device tables ({device['device_lookup_fraction']:.0%} of lookups on "
            f"the devices) against {host['steady_samples_per_s']:,.0f} with every table in the "
            f"host store; AUC {device['auc']:.4f} against {host['auc']:.4f}"
        )
        summary.update(
            steady_samples_per_s_b512_host=round(host["steady_samples_per_s"]),
            steady_samples_per_s_b512_device=round(device["steady_samples_per_s"]),
            device_over_host_b512=round(
                device["steady_samples_per_s"] / host["steady_samples_per_s"], 3
            ),
            device_lookup_fraction_b512=device["device_lookup_fraction"],
            auc_b512_host=round(host["auc"], 4),
        )
    if cached and host:
        print(
            f"batch 512, staleness 4, embedding.device_budget = {args.cache_budget:,}: steady "
            f"{cached['steady_samples_per_s']:,.0f} samples/s, "
            + (
                f"its caches held {cached['cache_hit_rate']:.1%} of their tables' lookups "
                if cached["cache_hit_rate"] is not None
                else "no hot-row cache planned "
            )
            + f"({cached['device_lookup_fraction']:.0%} of all lookups on the devices); AUC "
            f"{cached['auc']:.4f}"
        )
        summary.update(
            steady_samples_per_s_b512_cached=round(cached["steady_samples_per_s"]),
            cached_over_host_b512=round(
                cached["steady_samples_per_s"] / host["steady_samples_per_s"], 3
            ),
            cache_hit_rate_b512=cached["cache_hit_rate"],
            auc_b512_cached=round(cached["auc"], 4),
        )
    if sync:
        print(
            f"AUC per seed at batch 512: hybrid {results[512]['auc_per_seed']}, "
            f"synchronous {sync['auc_per_seed']}"
        )
        summary.update(
            auc_sync_b512=round(sync["auc"], 4),
            hybrid_over_sync_b512=round(
                results[512]["steady_samples_per_s"] / sync["steady_samples_per_s"], 3
            ),
        )
    if args.server:
        summary.update(_against_a_server(data, work, env, args.extra, args.cache_budget))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
