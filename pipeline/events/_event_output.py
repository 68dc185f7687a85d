"""Publishing an event-log dataset: the buckets' files renamed in bucket order, the rejected
rows' lines counted from their file's start, metadata.json, then `_SUCCESS` last."""

from __future__ import annotations

import dataclasses
import json
import os

from apache_beam.io.filesystems import FileSystems
from hybridrec.common.errors import UserError
from hybridrec.pipeline import _output, hashing, metadata
from hybridrec.pipeline.events._histories import chunk_limit
from hybridrec.pipeline.events.event_spec import EventSpec
from hybridrec.pipeline.events.event_stats import EventStats

ITEMS = "items"  # the item names: the raw id of each hashed item id


def publish(
    config,
    spec: EventSpec,
    chunks,
    temp_dir: str,
    stats: EventStats,
    runner: str,
    *,
    outputs,
    boundaries,
):
    """Renames the buckets' files in bucket order, the rejected rows' lines to file lines;
    writes metadata.json, then `_SUCCESS` last."""
    out = config.output
    if stats.lines == 0:
        _output.discard_partial(temp_dir)
        raise UserError(f"no input rows: every input file is empty ({', '.join(config.inputs)})")
    if not stats.users:
        rejected = sum(stats.rejected_by_reason.values())
        reasons = ", ".join(f"{k}={v:,}" for k, v in sorted(stats.rejected_by_reason.items()))
        message = (
            f"no user has {spec.min_events} events or more (min_events): {stats.events:,} "
            f"valid events of {stats.lines:,} rows, {stats.users_below_min_events:,} users "
            f"below the minimum, {rejected:,} rows rejected" + (f" ({reasons})" if reasons else "")
        )
        if rejected:  # kept for a look, where they cannot touch a complete dataset
            complete = FileSystems.exists(FileSystems.join(out, metadata.SUCCESS_FILE))
            where = temp_dir if complete else out
            files = _publish_rejected(where, temp_dir, stats)
            message += f"; see {FileSystems.join(where, files[0])}"
        _output.discard_partial(temp_dir, keep_rejected=True)
        raise UserError(message)
    _output.remove_previous(out, outputs)
    written = {name for name, _, _ in stats.files if name not in ("rejected", ITEMS)}
    splits = {
        split: _publish_parts(out, temp_dir, stats, split)
        for split in sorted(written, key=_split_order)
    }
    rejected_files = _publish_rejected(out, temp_dir, stats)
    meta = {
        "format_version": metadata.FORMAT_VERSION,
        "kind": "events",
        "hash_scheme": hashing.hash_scheme(spec.prefix_bits),
        "spec": _spec_json(spec),
        "tables": list(spec.tables),
        "splits": splits,
        # the raw id of every hashed item id (item uint64, name binary): serving's names
        "item_names": _publish_parts(out, temp_dir, stats, ITEMS),
        "boundaries": list(boundaries or []),
        "inputs": list(config.inputs),
        "input_files": list(dict.fromkeys(chunk.path for chunk in chunks)),
        **stats.to_json(spec),
        "rejected": {
            "rows": sum(stats.rejected_by_reason.values()),
            "by_reason": dict(sorted(stats.rejected_by_reason.items())),
            "files": rejected_files,
        },
        "runner": runner,
    }
    _output.commit(out, temp_dir, meta)
    return meta


def _publish_parts(out: str, temp_dir: str, stats: EventStats, kind: str) -> dict:
    """Renames the buckets' `kind` files (a split, or the item names) in bucket order."""
    keys = sorted(key for name, key, _ in stats.files if name == kind)
    names = [f"{kind}/part-{i:05d}-of-{len(keys):05d}.parquet" for i in range(len(keys))]
    sources = [FileSystems.join(temp_dir, kind, f"part-{key}.parquet") for key in keys]
    if "://" not in out:
        os.makedirs(os.path.join(out, kind), exist_ok=True)
    FileSystems.rename(sources, [FileSystems.join(out, name) for name in names])
    rows = sum(count for name, _, count in stats.files if name == kind)
    return {"rows": rows, "files": names}


def _split_order(name: str) -> tuple[int, int]:
    """train, valid, test, then window_1, window_2, ..."""
    if name.startswith("window_"):
        return 3, int(name.removeprefix("window_"))
    return ("train", "valid", "test").index(name), 0


def _publish_rejected(out: str, temp_dir: str, stats: EventStats) -> list[str]:
    """The rejected rows, in input order, with their lines counted from their file's start."""
    keys = sorted(key for name, key, _ in stats.files if name == "rejected")
    if not keys:
        return []
    first_line: dict[tuple[int, int], int] = {}
    running: dict[int, int] = {}
    for file_index, chunk_index, lines in sorted(stats.chunk_lines):
        first_line[(file_index, chunk_index)] = running.get(file_index, 0)
        running[file_index] = running.get(file_index, 0) + lines
    names = []
    if "://" not in out:
        os.makedirs(os.path.join(out, "rejected"), exist_ok=True)
    for index, key in enumerate(keys):
        file_index, chunk_index = (int(part) for part in key.split("-"))
        offset = first_line.get((file_index, chunk_index), 0)
        with FileSystems.open(FileSystems.join(temp_dir, "rejected", f"chunk-{key}.jsonl")) as f:
            records = [json.loads(line) for line in f.read().decode().splitlines()]
        for record in records:
            if "line" in record:
                record["line"] += offset + 1  # 1-based file lines
            else:
                record["row"] += offset
        name = f"rejected/rejected-{index:05d}-of-{len(keys):05d}.jsonl"
        with FileSystems.create(FileSystems.join(out, name)) as handle:
            handle.write("".join(json.dumps(r) + "\n" for r in records).encode())
        names.append(name)
    return names


def _spec_json(spec: EventSpec) -> dict:
    data = dataclasses.asdict(spec)
    data["action_types"] = list(spec.action.type_names) if spec.action else []
    data["side_features"] = [list(pair) for pair in spec.side_features]
    data["chunk_limit"] = chunk_limit(spec)
    return data
