"""The job's output directory: made ready before the run, published by the launcher after it.

Workers write everything under `OUT/_temporary/` with names that depend only on the
input chunk (`train/chunk-KEY.parquet`, `rejected/chunk-KEY.jsonl`, `stats.pickle`), so
a retried chunk overwrites its own files and nothing else. After a successful run the
launcher renames them into their final names in input order, writes metadata.json and
then `_SUCCESS`, last. A failed run leaves no `_SUCCESS` and no final files.
"""

from __future__ import annotations

import json
import os
import pickle

from apache_beam.io.filesystems import FileSystems
from hybridrec.common.errors import UserError
from hybridrec.pipeline import hashing, metadata
from hybridrec.pipeline.config import PreprocessConfig
from hybridrec.pipeline.stats import PartialStats

TEMP_DIR = "_temporary"
STATS_FILE = "stats.pickle"
LOG_FILE = "beam-workers.log"
# What a previous run may have left: all of it goes before a new run starts.
_OUTPUTS = ("metadata.json", "train", "eval", "rejected", TEMP_DIR)


def _is_local(path: str) -> bool:
    return "://" not in path


def prepare(out: str, overwrite: bool) -> None:
    """Empties `out` of a previous run's files; refuses a complete one without `overwrite`."""
    success = FileSystems.join(out, metadata.SUCCESS_FILE)
    if FileSystems.exists(success):
        if not overwrite:
            raise UserError(
                f"{out} already holds a complete dataset; pass --overwrite to replace it"
            )
        FileSystems.delete([success])  # from here on the directory is clearly incomplete
    stale = [FileSystems.join(out, name) for name in _OUTPUTS]
    stale = [path for path in stale if FileSystems.exists(path)]
    if stale:
        FileSystems.delete(stale)
    if _is_local(out):
        if os.path.exists(out) and not os.path.isdir(out):
            raise UserError(f"--output {out} exists and is not a directory")
        os.makedirs(out, exist_ok=True)


def discard_partial(temp_dir: str) -> None:
    """After a failed run: removes the workers' partial files, keeps the worker log."""
    names = ("train", "eval", "rejected", "stats", "progress", STATS_FILE)
    paths = [FileSystems.join(temp_dir, name) for name in names]
    paths = [path for path in paths if FileSystems.exists(path)]
    if paths:
        FileSystems.delete(paths)


def write_stats(temp_dir: str, stats: PartialStats) -> None:
    """Writes the combined statistics for the launcher (called by the job's last step)."""
    path = FileSystems.join(temp_dir, STATS_FILE)
    with FileSystems.create(f"{path}.tmp") as handle:
        handle.write(pickle.dumps(stats))
    FileSystems.rename([f"{path}.tmp"], [path])


def read_stats(temp_dir: str) -> PartialStats:
    path = FileSystems.join(temp_dir, STATS_FILE)
    if not FileSystems.exists(path):
        raise RuntimeError(
            f"the Beam runner reported success but the job's last step did not run ({path} "
            "is missing); the runner skipped part of the pipeline"
        )
    with FileSystems.open(path) as handle:
        return pickle.loads(handle.read())


def _rename_in_order(out: str, temp_dir: str, stats: PartialStats, kind: str) -> list[str]:
    """Moves the temp files of `kind` (a split or "rejected") to their final, ordered names."""
    keys = sorted(key for name, key, _ in stats.files if name == kind)
    extension = "jsonl" if kind == "rejected" else "parquet"
    prefix = "rejected/rejected" if kind == "rejected" else f"{kind}/part"
    sources, targets, relative = [], [], []
    for index, key in enumerate(keys):
        name = f"{prefix}-{index:05d}-of-{len(keys):05d}.{extension}"
        sources.append(FileSystems.join(temp_dir, kind, f"chunk-{key}.{extension}"))
        targets.append(FileSystems.join(out, name))
        relative.append(name)
    if sources:
        if _is_local(out):
            os.makedirs(os.path.join(out, kind), exist_ok=True)
        FileSystems.rename(sources, targets)
    return relative


def publish_rejected(out: str, temp_dir: str, stats: PartialStats) -> list[str]:
    """Moves the rejected-row files to `OUT/rejected/` (also when the job then fails)."""
    return _rename_in_order(out, temp_dir, stats, "rejected")


def finalize(
    out: str,
    temp_dir: str,
    spec,
    stats: PartialStats,
    config: PreprocessConfig,
    *,
    runner: str,
    input_files: list[str],
    rejected_files: list[str],
) -> dict:
    """Renames the Parquet files into their final names, writes metadata.json, then _SUCCESS."""
    splits = {}
    for split in ("train", "eval"):
        files = _rename_in_order(out, temp_dir, stats, split)
        rows = sum(count for name, _, count in stats.files if name == split)
        splits[split] = {"rows": rows, "files": files}
    meta = {
        "format_version": metadata.FORMAT_VERSION,
        "hash_scheme": hashing.hash_scheme(spec.prefix_bits),
        "spec": spec.to_json(),
        "splits": splits,
        "split_rule": {"mode": config.split, "eval_fraction": config.eval_fraction},
        "inputs": list(config.inputs),
        "input_format": config.input_format,
        "input_files": input_files,
        **stats.to_json(spec),
        "rejected_files": rejected_files,
        "runner": runner,
    }
    with FileSystems.create(FileSystems.join(out, metadata.METADATA_FILE)) as handle:
        handle.write(json.dumps(meta, indent=1).encode())
    FileSystems.delete([temp_dir])
    with FileSystems.create(FileSystems.join(out, metadata.SUCCESS_FILE)) as handle:
        handle.write(b"")
    return meta
