"""Follow mode for event logs: new event files extend their users' histories.

    a complete event file (the follower's producer contract, `pipeline.follow`)
      ──► ParseEventFiles (one bounded Beam run per batch of files): parse and hash with
          the reference's frozen spec, join the item features; events and item names
          written under _temporary/
      ──► on the launcher, file after file in manifest order: each user's kept history
          (`UserState`: the last max_length events) joined with the file's new events,
          duplicates of kept events dropped, one row per user written as the shard
          (history, then the new events; `first_target` the first new one), the state
          updated, then the manifest line committed

A shard row has the form of a time split's window rows (docs/pipeline.md): the history
before the file, then the file's events, each a next-item target, so `train --follow`
trains every new event once and can evaluate a file before training on it (the
window T -> T+1 protocol). A new user's first event is history only.

Exactly once: the state after manifest line N is a function of the reference dataset
and shards 0..N (`pipeline.events._user_state`); it is snapshotted every `snapshot_every`
lines and at the end, and a restarted follower loads the newest snapshot and replays
the shards after it, so a kill at any moment neither loses nor repeats an event.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hybridrec.common.config import from_dict
from hybridrec.common.errors import UserError
from hybridrec.common.files import atomic_write_text, fsync_directory
from hybridrec.pipeline import _chunks, manifest, metadata
from hybridrec.pipeline._errors import InputError
from hybridrec.pipeline.events import _event_inputs, _event_read
from hybridrec.pipeline.events._event_parse import EventParser
from hybridrec.pipeline.events._histories import (
    Events,
    Examples,
    example_table,
    keep_last,
    ranges,
    split_encodings,
    user_runs,
)
from hybridrec.pipeline.events._user_state import STATE_DIR, UserState, read_rows, snapshots
from hybridrec.pipeline.events.event_spec import EventSpec

_WHOLE_FILE = 2**62
_SPEC_EXTRAS = ("action_types", "side_features", "chunk_limit")


def spec_of(meta: dict) -> EventSpec:
    """The event spec a dataset's metadata.json records."""
    data = {key: value for key, value in meta["spec"].items() if key not in _SPEC_EXTRAS}
    return from_dict(EventSpec, data)


def open_event_stream(output: Path, reference: str | Path) -> EventSpec:
    """Creates (or reopens) the stream `output` of the event dataset `reference`: its
    spec, hash scheme and statistics frozen in metadata.json, `splits` empty (rows come
    by the manifest), the reference's item names and path recorded."""
    ref = metadata.read_dataset(reference)
    path = output / metadata.METADATA_FILE
    if path.exists():
        existing = json.loads(path.read_text())
        if "stream" not in existing:
            raise UserError(f"{output} holds a batch dataset, not a stream; pick another --output")
        if existing.get("kind") != "events" or existing["spec"] != ref.raw["spec"]:
            raise UserError(
                f"{output} is a stream of another spec than --stats {reference}; pick another --output"
            )
        return spec_of(existing)
    output.mkdir(parents=True, exist_ok=True)
    frozen = {key: ref.raw[key] for key in ("format_version", "kind", "hash_scheme", "spec", "tables", "sequence") if key in ref.raw}  # fmt: skip
    names = ref.raw.get("item_names") or {"rows": 0, "files": []}
    frozen["item_names"] = {
        "rows": names["rows"],
        "files": [str((ref.root / name).resolve()) for name in names["files"]],
    }
    frozen["splits"] = {}
    frozen["stream"] = {"manifest": manifest.MANIFEST_FILE, "reference": str(Path(reference).resolve())}  # fmt: skip
    atomic_write_text(path, json.dumps(frozen, indent=1))
    (output / metadata.SUCCESS_FILE).touch()
    fsync_directory(output)
    return spec_of(frozen)


def _sides(spec: EventSpec) -> list[str]:
    return [name for name, _ in spec.side_features]


def _keep(spec: EventSpec) -> int:
    return spec.max_length or spec.max_events_per_user


def reference_state(reference: Path, spec: EventSpec) -> UserState:
    """Each reference user's newest row's last max_length events (splits in order: train,
    valid, test, window_1, ...; a later split's row is the newer)."""
    ref = metadata.read_dataset(reference)
    state = UserState(_sides(spec), _keep(spec))
    columns = ["user", *state.columns]
    for split in ref.raw["splits"]:
        state.update_from_rows(read_rows(ref.split_files(split), columns))
    return state


# ---- the Beam step: one file's events ------------------------------------------------------


class _ParseEventFileFn(beam.DoFn):
    """(seq, path) -> `events.arrow`, `names.arrow`, rejected rows and `result.json`."""

    def __init__(self, spec: EventSpec, temp_dir: str, block_bytes: int):
        self.spec, self.temp_dir, self.block_bytes = spec, temp_dir, block_bytes

    def setup(self):
        self.parser = EventParser(self.spec)
        self.item_features = _event_inputs.load_item_features(self.spec) if self.spec.items else None  # fmt: skip

    def process(self, item: tuple[int, str]):
        seq, path = item
        directory = os.path.join(self.temp_dir, f"{seq:06d}")
        shutil.rmtree(directory, ignore_errors=True)  # a retried element starts clean
        os.makedirs(directory)
        result = self._parse(path, directory)
        atomic_write_text(os.path.join(directory, "result.json"), json.dumps(result))
        yield seq

    def _parse(self, path: str, directory: str) -> dict[str, Any]:
        try:
            (chunk,) = _chunks.list_chunks([path], _WHOLE_FILE)
            if chunk.format == "parquet":
                with pq.ParquetFile(path) as parquet_file:
                    _event_inputs.check_event_schema(parquet_file.schema_arrow, self.spec, path)
            read = _event_read.read_chunk_events(chunk, self.spec, self.parser, self.block_bytes)
        except InputError as error:
            return {"error": error.plain}
        except UserError as error:
            return {"error": str(error)}
        except (OSError, EOFError, ValueError, pa.ArrowException) as error:
            return {"error": f"{path}: unreadable: {error}"}
        stats, rejected = read.stats, read.rejected
        if rejected:
            with open(os.path.join(directory, "rejected.jsonl"), "w") as handle:
                handle.write("".join(json.dumps(record) + "\n" for record in rejected))
        if stats.lines == 0:
            return {"error": f"{path}: empty file (no events)"}
        if stats.events == 0:
            counts = ", ".join(f"{r} {n}" for r, n in sorted(stats.rejected_by_reason.items()))
            first = rejected[0]
            return {
                "error": f"{path}: every event rejected ({counts}); first: "
                f"{first.get('reason')}: {first.get('detail', '')} (a different layout than the reference's spec?)"
            }
        events = read.events
        if self.item_features is not None:
            events.sides.update(self.item_features.join(events.items))
        _write_table(os.path.join(directory, "events.arrow"), events.to_table())
        ids, names = read.item_names()
        _write_table(os.path.join(directory, "names.arrow"), pa.table({"item": ids, "name": names}))  # fmt: skip
        counts = np.unique(events.users, return_counts=True)
        over = counts[0][counts[1] > self.spec.max_events_per_user]
        capped = read.user_names(set(over.tolist()))
        return {
            "events": stats.events,
            "rejected": len(rejected),
            "rejected_by_reason": stats.rejected_by_reason,
            "capped_users": {
                name: int(counts[1][counts[0] == user][0]) for user, name in capped.items()
            },  # fmt: skip
        }


def _write_table(path: str, table: pa.Table) -> None:
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def _read_table(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all()


# ---- on the launcher: histories joined, rows written, state kept ----------------------------


def stream_rows(state: UserState, events: Events, spec: EventSpec) -> tuple[pa.Table, dict]:
    """One file's rows: per user its kept history then its new events (duplicates of an
    earlier event dropped, the most recent `max_events_per_user` kept), and the counts.
    Updates `state`."""
    order = events.time_order()
    users_sorted = events.users[order]
    starts, lengths = user_runs(users_sorted)
    users = users_sorted[starts]
    hist_lengths, hist = state.histories(users)
    hist_events = Events(
        users=np.repeat(users, hist_lengths),
        items=hist["items"],
        times=hist["times"],
        actions=hist["actions"],
        sides={name: hist[name] for name in events.sides},
        files=np.full(len(hist["items"]), -1, np.int32),  # earlier than any new event
        chunks=np.zeros(len(hist["items"]), np.int32),
        lines=np.arange(len(hist["items"]), dtype=np.int64),
        positions=np.zeros(len(hist["items"]), np.int32),
    )
    new = events.take(order)
    duplicates = 0
    if spec.drop_duplicates and len(new):
        pool = Events.concat([hist_events, new], list(events.sides))
        pool_order = pool.time_order()
        duplicate = np.zeros(len(pool), bool)
        duplicate[pool_order[pool.duplicate_mask(pool_order)]] = True
        fresh = ~duplicate[len(hist_events) :]
        duplicates = int((~fresh).sum())
        new = new.take(np.flatnonzero(fresh))
    starts, new_lengths = user_runs(new.users)
    capped = int((new_lengths > spec.max_events_per_user).sum())
    new = new.take(keep_last(starts, new_lengths, spec.max_events_per_user))
    starts, new_lengths = user_runs(new.users)
    present = np.isin(users, new.users[starts]) if len(new) else np.zeros(len(users), bool)
    # rows: the users with a new event left, each its history then its new events
    hist_offsets = np.cumsum(hist_lengths) - hist_lengths
    row_users, row_hist = users[present], hist_lengths[present]
    pool = Events.concat([hist_events, new], list(events.sides))
    firsts = np.stack([hist_offsets[present], len(hist_events) + starts], axis=1).reshape(-1)
    counts = np.stack([row_hist, new_lengths], axis=1).reshape(-1)
    index = ranges(firsts, counts)
    lengths = row_hist + new_lengths
    late = 0
    if spec.time and len(new):
        last = np.where(row_hist > 0, pool.times[np.maximum(hist_offsets[present] + row_hist - 1, 0)], np.iinfo(np.int64).min)  # fmt: skip
        late = int((new.times < np.repeat(last, new_lengths)).sum())
    first_target = np.maximum(row_hist, 1)
    rows = Examples.of(row_users, None, lengths, first_target.astype(np.int32), events=index)
    table = example_table(rows, pool, spec)  # the event job's example form
    state.set(row_users, lengths, {name: _column(pool, name)[index] for name in state.columns})
    return table, {
        "events": len(new),
        "targets": int((lengths - first_target).clip(min=0).sum()),
        "users": len(row_users),
        "new_users": int((row_hist == 0).sum()),
        "duplicates": duplicates,
        "late_events": late,
        "capped_users_count": capped,
    }


def _column(events: Events, name: str) -> np.ndarray:
    return events.sides[name] if name in events.sides else getattr(events, name)


class EventFiles:
    """The event-log side of `pipeline.follow.follow`: parses files in the Beam step, and
    on the launcher turns each into its users' rows against the kept histories.

    Args:
        out: the stream dataset directory.
        reference: the event dataset whose spec and statistics are frozen.
        snapshot_every: manifest lines between snapshots of the users' state.
    """

    kind = "events"
    folders = ("shards", "rejected", "dead_letter", "items", "state")  # the stream's directory

    def __init__(self, out: Path, reference: str, *, block_bytes: int, compression: str, snapshot_every: int = 50):  # fmt: skip
        self.out, self.reference = out, Path(reference)
        self.spec = open_event_stream(out, reference)
        self.block_bytes, self.compression = block_bytes, compression
        self.snapshot_every = snapshot_every
        self.state: UserState | None = None
        self.known_items = np.zeros(0, np.uint64)
        self.lines = 0  # manifest lines the state covers
        self.snapshot_lines = -1

    def dofn(self, temp_dir: str) -> beam.DoFn:
        return _ParseEventFileFn(self.spec, temp_dir, self.block_bytes)

    def recover(self, entries: list[manifest.ManifestEntry]) -> None:
        """The state after the committed lines: the newest snapshot, then the shards after it."""
        (self.out / STATE_DIR).mkdir(exist_ok=True)
        for leftover in (self.out / STATE_DIR).glob("*.tmp"):
            leftover.unlink()
        taken = [(lines, path) for lines, path in snapshots(self.out) if lines <= len(entries)]
        if taken:
            self.lines, path = taken[-1]
            self.state = UserState.load(path, _sides(self.spec), _keep(self.spec))
        else:
            self.lines, self.state = 0, reference_state(self.reference, self.spec)
        replay = [e for e in entries[self.lines :] if e.is_shard]
        columns = ["user", *self.state.columns]
        for entry in replay:
            self.state.update_from_rows(read_rows([self.out / entry.shard], columns))
        self.lines = len(entries)
        ids, _ = metadata.read_dataset(self.out).item_names()
        self.known_items = ids
        self.snapshot_lines = taken[-1][0] if taken else -1
        if self.lines - self.snapshot_lines >= self.snapshot_every or not taken:
            self._snapshot()

    def prepare(self, seq: int, temp: Path, result: dict) -> dict:
        """Writes the file's shard (and new item names) under `temp`; returns what the
        manifest line gets besides the shard."""
        if "error" in result:
            return result
        events = Events.from_table(_read_table(temp / "events.arrow"))
        table, counts = stream_rows(self.state, events, self.spec)
        (temp / "train").mkdir(exist_ok=True)
        path = temp / "train" / "chunk-00000-00000.parquet"
        pq.write_table(table, path, compression=self.compression, **split_encodings(table))
        names = _read_table(temp / "names.arrow")
        ids = names.column("item").to_numpy()
        new = ~np.isin(ids, self.known_items)
        fields: dict[str, Any] = dict(counts)
        moves = {}
        if new.any():
            name = f"{manifest.ITEMS_DIR}/items-{seq:06d}.parquet"
            pq.write_table(names.filter(pa.array(new)), temp / "items.parquet")
            moves[str(temp / "items.parquet")] = name  # committed with the line
            self.known_items = np.union1d(self.known_items, ids[new])
            fields |= {"items_file": name, "new_items": int(new.sum())}
        if result.get("capped_users"):
            fields["capped_users"] = result["capped_users"]
        return {**result, "rows": table.num_rows, "fields": fields, "moves": moves}

    def committed(self) -> None:
        self.lines += 1
        if self.lines - self.snapshot_lines >= self.snapshot_every:
            self._snapshot()

    def close(self) -> None:
        if self.state is not None and self.lines != self.snapshot_lines:
            self._snapshot()

    def _snapshot(self) -> None:
        path = self.out / STATE_DIR / f"state-{self.lines:06d}.arrow"
        self.state.save(path)
        self.snapshot_lines = self.lines
        for lines, old in snapshots(self.out):
            if lines < self.lines:
                old.unlink()
