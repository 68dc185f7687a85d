"""Quantized embedding checkpoints on Criteo data: bytes, write time and AUC after a restore.

In one run (the `criteo_dlrm` preset, synchronous, so two runs over the same data are
the same run and a difference in AUC is the checkpoint's):
  1. preprocess the input once (cached like scripts/bench_criteo.py);
  2. reference: train one epoch with no restore; its final AUC and final full fp32
     embedding checkpoint;
  3. per precision: train to mid-epoch (`data.max_steps`), checkpoint at that precision,
     resume from the checkpoint in a new process and finish the epoch; the final AUC
     against the reference (fp32 is the control: the restore itself must cost nothing);
     at int8 the run's final checkpoint is an incremental int8 one over the mid-epoch
     checkpoint, compared with the reference's full fp32 checkpoint after the same steps;
  4. the reference's final embeddings restored in this process and written in full at
     each precision: bytes (as counted and on disk) and write seconds (median of --repeats).

Steps 2 and 3 run for every `--seeds` seed; the AUC deltas are their means (a restore
perturbs the rows slightly, and training carries any perturbation on, so one seed's delta
is noisy at the 1e-3 scale).

    python scripts/bench_checkpoint.py                     # the shared Criteo sample
    python scripts/bench_checkpoint.py --seeds 0 1 2       # more seeds
    python scripts/bench_checkpoint.py --input day_0.gz    # any Criteo-format files

The last line is one JSON object (keys: int8_bytes_ratio, int8_auc_delta, int4_bytes_ratio,
int4_auc_delta, incremental_int8_bytes_ratio, fp16_bytes_ratio, fp32_restore_auc_delta,
int8_write_time_ratio, int4_write_time_ratio, auc_reference, targets_met).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_criteo import REPO, _dataset, _fail, checked_inputs
from hybridrec.common import config as config_lib
from hybridrec.embedding_store import EmbeddingStore, TableConfig, checkpoint

PRECISIONS = ("fp32", "fp16", "int8", "int4")
TARGETS = {"int8_bytes_ratio": 0.4, "int4_bytes_ratio": 0.3, "int8_auc_delta": 0.001}


def _train(data: Path, run_dir: Path, settings: list[str], *, resume: bool) -> dict:
    """One `hybridrec train` process; its summary.json."""
    command = [sys.executable, "-m", "hybridrec", "train", "--config", "criteo_dlrm"]
    command += ["--data", str(data), "--run-dir", str(run_dir), "--quiet"]
    command += ["--resume"] if resume else []
    for setting in ["hybrid.staleness=0", "log.tensorboard=false", *settings]:
        command += ["--set", setting]
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the trainer's own device layout
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode:
        sys.stderr.write(result.stdout[-3000:] + result.stderr[-3000:])
        _fail(f"training into {run_dir} failed (exit {result.returncode})")
    summary = json.loads((run_dir / "summary.json").read_text())
    print(
        f"   {run_dir.name}{' (resumed)' if resume else ''}: {summary['steps']} steps, "
        f"AUC {summary['eval']['auc']:.5f} ({time.perf_counter() - start:.0f} s)",
        flush=True,
    )
    return summary


def _embeddings(run_dir: Path) -> str:
    return str(run_dir / "checkpoints" / "embeddings")


def _group_bytes(url: str, step: int, position: int = -1) -> int:
    """Bytes of every table's snapshot group `position` in the chain of `step`."""
    manifest = checkpoint.read_manifest(url, step)
    return sum(
        entry["bytes"]
        for table in manifest["tables"].values()
        for entry in table["chain"][position]["parts"]
    )


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _write_each_precision(url: str, step: int, repeats: int, work: Path) -> dict[str, dict]:
    """Restores `url` at `step` and writes it in full at every precision."""
    manifest = checkpoint.read_manifest(url, step)
    tables = [
        config_lib.from_dict(TableConfig, table["config"], where=f"table {name}")
        for name, table in manifest["tables"].items()
    ]
    results = {}
    with EmbeddingStore.restore(url, tables, num_shards=manifest["num_shards"]) as store:
        rows = store.stats()["rows"]
        for precision in PRECISIONS:
            seconds = []
            for attempt in range(repeats):
                target = work / f"full-{precision}-{attempt}"
                shutil.rmtree(target, ignore_errors=True)
                info = store.checkpoint(str(target), step, full=True, precision=precision)
                seconds.append(info["seconds"])
            results[precision] = {
                "bytes": info["bytes_written"],
                "disk_bytes": _disk_bytes(target),
                "seconds": statistics.median(seconds),
            }
            print(
                f"   full {precision}: {rows:,} rows, {info['bytes_written'] / 2**20:.1f} MiB "
                f"({results[precision]['disk_bytes'] / 2**20:.1f} MiB on disk), "
                f"{results[precision]['seconds']:.2f} s",
                flush=True,
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", type=Path, help="Criteo-format files")
    parser.add_argument("--cache", type=Path, default=REPO / "runs" / "bench_criteo")
    parser.add_argument("--batch", type=int, default=1024, help="global batch size")
    parser.add_argument(
        "--restore-precisions", nargs="+", default=["fp32", "int8", "int4"], choices=PRECISIONS
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed writes per precision")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="seeds; AUC deltas are their mean"
    )
    args = parser.parse_args()
    inputs = checked_inputs(args.input)
    data = _dataset(inputs, args.cache)
    work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    try:
        summary = _run(data, work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(summary))


def _restore_runs(data: Path, work: Path, args, seed: int) -> dict:
    """The reference and the restored runs of one seed: AUCs, steps, checkpoint bytes."""
    common = [f"data.batch_size={args.batch}", "log.every_steps=50", f"seed={seed}"]
    print(f"\n== seed {seed}, reference: one epoch, no restore", flush=True)
    reference_dir = work / f"reference-seed{seed}"
    reference = _train(data, reference_dir, common, resume=False)
    end = reference["steps"]
    middle = end // 2
    result = {
        "auc": reference["eval"]["auc"],
        "end": end,
        "middle": middle,
        "reference_dir": reference_dir,
        "full_fp32_end": _group_bytes(_embeddings(reference_dir), end),
        "aucs": {},
        "incremental": None,
    }
    for precision in args.restore_precisions:
        print(f"\n== seed {seed}, {precision}: checkpoint at step {middle}, restore, finish")
        run_dir = work / f"restored-{precision}-seed{seed}"
        settings = [*common, f"checkpoint.precision={precision}"]
        _train(data, run_dir, [*settings, f"data.max_steps={middle}"], resume=False)
        result["aucs"][precision] = _train(data, run_dir, settings, resume=True)["eval"]["auc"]
        if precision == "int8":
            result["incremental"] = _group_bytes(_embeddings(run_dir), end)
    return result


def _run(data: Path, work: Path, args) -> dict:
    runs = [_restore_runs(data, work, args, seed) for seed in args.seeds]
    first = runs[0]
    end, middle, incremental = first["end"], first["middle"], first["incremental"]
    full_fp32_end = first["full_fp32_end"]
    auc = statistics.mean(run["auc"] for run in runs)
    deltas = {
        precision: [run["aucs"][precision] - run["auc"] for run in runs]
        for precision in args.restore_precisions
    }
    aucs = {p: auc + statistics.mean(d) for p, d in deltas.items()}
    for precision, values in deltas.items():
        print(f"AUC delta per seed, {precision}: {[round(v, 5) for v in values]}")
    print(f"\n== full checkpoints of the reference's {end}-step embeddings", flush=True)
    written = _write_each_precision(
        _embeddings(first["reference_dir"]), end, args.repeats, work / "full"
    )
    fp32 = written["fp32"]
    print(
        "\n| precision | bytes | x fp32 | on disk | x fp32 | write s | x fp32 | AUC after restore | delta |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for precision, result in written.items():
        restored = aucs.get(precision)
        print(
            f"| {precision} | {result['bytes']:,} | {result['bytes'] / fp32['bytes']:.3f} | "
            f"{result['disk_bytes']:,} | {result['disk_bytes'] / fp32['disk_bytes']:.3f} | "
            f"{result['seconds']:.2f} | {result['seconds'] / fp32['seconds']:.2f} | "
            + (f"{restored:.5f} | {restored - auc:+.5f} |" if restored is not None else "- | - |")
        )
    print(
        f"reference AUC (no restore, mean of seeds {args.seeds}): {auc:.5f}; steps {end}, "
        f"checkpoint at {middle}; AUC after restore and delta: means over the seeds"
    )
    out = {
        f"{p}_bytes_ratio": round(written[p]["bytes"] / fp32["bytes"], 4) for p in PRECISIONS[1:]
    }
    out.update(
        {f"{p}_auc_delta": round(aucs[p] - auc, 5) for p in aucs if p != "fp32"},
        auc_deltas_per_seed={p: [round(v, 5) for v in d] for p, d in deltas.items()},
        seeds=args.seeds,
        fp32_restore_auc_delta=round(aucs["fp32"] - auc, 5) if "fp32" in aucs else None,
        incremental_int8_bytes_ratio=round(incremental / full_fp32_end, 4)
        if incremental is not None
        else None,
        int8_write_time_ratio=round(written["int8"]["seconds"] / fp32["seconds"], 3),
        int4_write_time_ratio=round(written["int4"]["seconds"] / fp32["seconds"], 3),
        int8_disk_ratio=round(written["int8"]["disk_bytes"] / fp32["disk_bytes"], 4),
        int4_disk_ratio=round(written["int4"]["disk_bytes"] / fp32["disk_bytes"], 4),
        auc_reference=round(auc, 5),
        steps=end,
        batch=args.batch,
    )
    out["targets_met"] = {
        "int8_bytes": out["int8_bytes_ratio"] <= TARGETS["int8_bytes_ratio"],
        "int8_auc": abs(out.get("int8_auc_delta", 1.0)) <= TARGETS["int8_auc_delta"],
        "int4_bytes": out["int4_bytes_ratio"] <= TARGETS["int4_bytes_ratio"],
    }
    return out


if __name__ == "__main__":
    main()
