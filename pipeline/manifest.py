"""The append-only manifest of a stream dataset (`hybridrec preprocess --follow`).

A stream dataset directory holds:

    metadata.json + _SUCCESS   the reference dataset's spec, hash scheme and statistics
                               (frozen: the stream is encoded exactly as the reference was),
                               with `"stream": {...}` naming the manifest
    manifest.jsonl             one JSON line per input file handled, in commit order
    shards/part-NNNNNN.parquet one micro-batch shard per accepted input file
    rejected/rejected-NNNNNN.jsonl   rejected rows of a shard's file, with reasons
    dead_letter/NNNNNN-NAME    copies of files that could not be read, and NAME.reason.txt
    items/items-NNNNNN.parquet event streams: raw ids of the items a shard's file brought
                               first (the line's `items_file`)
    state/state-NNNNNN.arrow   event streams: each user's kept events after N lines

Each line is committed atomically: its files are complete on disk (written, fsynced,
renamed) before the line is appended in one `write` and fsynced, so a line names only
complete files. A process killed mid-append leaves at most a torn last line without
its newline; readers ignore it and the follower truncates it on restart. A line's
`seq` is its index in the file, so a restarted follower knows exactly which files it
already handled and which shard names are free.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from hybridrec.common.errors import UserError
from hybridrec.common.files import fsync_directory

MANIFEST_FILE = "manifest.jsonl"
SHARDS_DIR = "shards"
DEAD_LETTER_DIR = "dead_letter"
REJECTED_DIR = "rejected"
ITEMS_DIR = "items"  # event streams: the raw ids of the items each file brought first


@dataclasses.dataclass(frozen=True)
class ManifestEntry:
    """One committed line: an input file that became a shard or a dead letter."""

    seq: int  # index of the line in the manifest
    kind: str  # "shard" or "dead_letter"
    source: str  # the input file
    rows: int  # rows in the shard (0 for a dead letter)
    shard: str  # shard path relative to the dataset directory ("" for a dead letter)
    reason: str  # why the file is a dead letter ("" for a shard)
    raw: dict  # the whole line

    @property
    def is_shard(self) -> bool:
        return self.kind == "shard"


def shard_name(seq: int) -> str:
    """The shard path (relative to the dataset directory) of manifest line `seq`."""
    return f"{SHARDS_DIR}/part-{seq:06d}.parquet"


def _parse(lines: list[str], path: Path) -> list[ManifestEntry]:
    entries = []
    for index, line in enumerate(lines):
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{path}: line {index + 1}: not JSON ({error})") from None
        if raw.get("seq") != index:
            raise UserError(f"{path}: line {index + 1}: seq {raw.get('seq')!r}, expected {index}")
        entries.append(entry_from_dict(raw))
    return entries


def entry_from_dict(raw: dict[str, Any]) -> ManifestEntry:
    """The entry of one manifest line, parsed."""
    return ManifestEntry(
        seq=int(raw["seq"]),
        kind=raw["kind"],
        source=raw["source"],
        rows=int(raw.get("rows", 0)),
        shard=raw.get("shard", ""),
        reason=raw.get("reason", ""),
        raw=raw,
    )


def read_manifest(data_dir: str | Path) -> list[ManifestEntry]:
    """Every committed line of `data_dir/manifest.jsonl` (a torn last line is not committed).

    Raises:
        UserError: a committed line is not JSON or out of sequence.
    """
    path = Path(data_dir) / MANIFEST_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    lines = text.split("\n")[:-1]  # the part after the last newline is torn or empty
    return _parse(lines, path)


def read_shards(data_dir: str | Path, start: int = 0) -> list[ManifestEntry]:
    """The shard lines of the manifest, in commit order, from shard index `start` on."""
    return [entry for entry in read_manifest(data_dir) if entry.is_shard][start:]


def repair(data_dir: str | Path) -> int:
    """Truncates a torn last line (a writer killed mid-append); returns committed lines."""
    path = Path(data_dir) / MANIFEST_FILE
    if not path.exists():
        return 0
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep != len(data):
        with open(path, "r+b") as handle:
            handle.truncate(keep)
            os.fsync(handle.fileno())
    return data[:keep].count(b"\n")


def append(data_dir: str | Path, entry: dict[str, Any]) -> None:
    """Commits one line: one `write` on an append-only descriptor, then fsync."""
    path = Path(data_dir) / MANIFEST_FILE
    line = (json.dumps(entry, sort_keys=True) + "\n").encode()
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(descriptor, line)
        if written != len(line):  # a full disk; the torn line is truncated on restart
            raise OSError(f"{path}: short write ({written} of {len(line)} bytes)")
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    if entry["seq"] == 0:
        fsync_directory(path.parent)
