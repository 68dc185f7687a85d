"""The job's output directory: made ready before the run, published by the launcher after it.

Workers write everything under `OUT/_temporary/` with names that depend only on the
input chunk (`train/chunk-KEY.parquet`, `rejected/chunk-KEY.jsonl`, `stats.pickle`), so
a retried chunk overwrites its own files and nothing else. After a successful run the
launcher removes the dataset a previous run completed there (under `--overwrite`),
renames the new files into their final names in input order, writes metadata.json and
then `_SUCCESS`, last. A failed run leaves no `_SUCCESS` and no final files, and a
complete dataset already in OUT stays as it was.
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
# The files of a click-log dataset, besides _SUCCESS; a new dataset replaces them when it
# is published (an event-log dataset has others: `pipeline.events.event_job`).
OUTPUTS = ("metadata.json", "train", "eval", "rejected")


def _is_local(path: str) -> bool:
    return "://" not in path


def prepare(out: str, overwrite: bool, outputs=OUTPUTS) -> None:
    """Readies `out` for a run: removes what a failed run left (of `outputs`); refuses a
    complete dataset without `overwrite`, and with it keeps that dataset until `publish`
    replaces it."""
    complete = FileSystems.exists(FileSystems.join(out, metadata.SUCCESS_FILE))
    if complete and not overwrite:
        raise UserError(f"{out} already holds a complete dataset; pass --overwrite to replace it")
    stale = [TEMP_DIR] if complete else [*outputs, TEMP_DIR]
    stale = [FileSystems.join(out, name) for name in stale]
    stale = [path for path in stale if FileSystems.exists(path)]
    if stale:
        FileSystems.delete(stale)
    if _is_local(out):
        if os.path.exists(out) and not os.path.isdir(out):
            raise UserError(f"--output {out} exists and is not a directory")
        os.makedirs(out, exist_ok=True)


def discard_partial(temp_dir: str, *, keep_rejected: bool = False) -> None:
    """After a failed run: removes the workers' partial files, keeps the worker log (and
    the rejected rows with `keep_rejected`)."""
    names = ("train", "eval", "valid", "test", "events", "users", "stats", "progress", STATS_FILE)
    names += () if keep_rejected else ("rejected",)
    paths = [FileSystems.join(temp_dir, name) for name in names]
    paths = [path for path in paths if FileSystems.exists(path)]
    if paths:
        FileSystems.delete(paths)


def write_stats(temp_dir: str, stats) -> None:
    """Writes the combined statistics (a click-log job's PartialStats, an event-log job's
    EventStats) for the launcher (called by the job's last step)."""
    path = FileSystems.join(temp_dir, STATS_FILE)
    with FileSystems.create(f"{path}.tmp") as handle:
        handle.write(pickle.dumps(stats))
    FileSystems.rename([f"{path}.tmp"], [path])


def read_stats(temp_dir: str):
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


def publish(
    out: str,
    temp_dir: str,
    spec,
    stats: PartialStats,
    config: PreprocessConfig,
    *,
    runner: str,
    input_files: list[str],
) -> dict:
    """Replaces the dataset in `out` with the new one: metadata.json, then _SUCCESS, last.

    Raises:
        UserError: no input rows, or every row rejected; the rejected rows are then kept
            (in `out/rejected/`, or under the temporary directory when `out` holds a
            complete dataset, which stays as it was).
    """
    if stats.rows_read == 0:
        raise UserError(f"no input rows: every input file is empty ({', '.join(config.inputs)})")
    if not sum(stats.rows_by_split.values()):
        raise UserError(_all_rejected(out, temp_dir, stats))
    remove_previous(out)
    rejected_files = _rename_in_order(out, temp_dir, stats, "rejected")
    splits = {}
    for split in ("train", "valid", "eval") if config.valid_fraction else ("train", "eval"):
        files = _rename_in_order(out, temp_dir, stats, split)
        rows = sum(count for name, _, count in stats.files if name == split)
        splits[split] = {"rows": rows, "files": files}
    meta = {
        "format_version": metadata.FORMAT_VERSION,
        "hash_scheme": hashing.hash_scheme(spec.prefix_bits),
        "spec": spec.to_json(),
        "splits": splits,
        "split_rule": {
            "mode": config.split,
            "eval_fraction": config.eval_fraction,
            **({"valid_fraction": config.valid_fraction} if config.valid_fraction else {}),
        },
        "inputs": list(config.inputs),
        "input_format": config.input_format,
        "input_files": input_files,
        **stats.to_json(spec),
        "rejected_files": rejected_files,
        "runner": runner,
    }
    commit(out, temp_dir, meta)
    return meta


def commit(out: str, temp_dir: str, meta: dict) -> None:
    """The last steps of a publish: metadata.json, the temporary directory removed, then
    `_SUCCESS`, which makes the dataset complete."""
    with FileSystems.create(FileSystems.join(out, metadata.METADATA_FILE)) as handle:
        handle.write(json.dumps(meta, indent=1).encode())
    FileSystems.delete([temp_dir])
    with FileSystems.create(FileSystems.join(out, metadata.SUCCESS_FILE)) as handle:
        handle.write(b"")


def remove_previous(out: str, outputs=OUTPUTS) -> None:
    """Removes a previous dataset's files, `_SUCCESS` first (from then on `out` is clearly
    incomplete)."""
    for names in ((metadata.SUCCESS_FILE,), outputs):
        paths = [FileSystems.join(out, name) for name in names]
        paths = [path for path in paths if FileSystems.exists(path)]
        if paths:
            FileSystems.delete(paths)


def _all_rejected(out: str, temp_dir: str, stats: PartialStats) -> str:
    """Keeps the rejected rows of a run that wrote none; the error message, with the
    counts by reason and the first rejected row."""
    complete = FileSystems.exists(FileSystems.join(out, metadata.SUCCESS_FILE))
    where = temp_dir if complete else out  # a complete dataset's own rejected/ stays
    files = _rename_in_order(where, temp_dir, stats, "rejected")
    discard_partial(temp_dir, keep_rejected=complete)
    reasons = ", ".join(f"{k}={v:,}" for k, v in sorted(stats.rejected_by_reason.items()))
    message = f"every input row was rejected ({stats.rows_read:,} rows: {reasons})"
    if files:
        with FileSystems.open(FileSystems.join(where, files[0])) as handle:
            first = json.loads(handle.readline())
        row = f":{first['line']}" if "line" in first else f" row {first['row']}"
        message += f"; first: {first['file']}{row}: {first['reason']} ({first['detail']})"
    message += f"; see {FileSystems.join(where, 'rejected')}"
    if complete:
        message += f" (the dataset already in {out} is unchanged)"
    return message
