"""Follow mode on event logs: new event files extend their users' histories, exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hybridrec.pipeline import PreprocessConfig, hashing, read_manifest
from hybridrec.pipeline.events.event_job import run_event_preprocess
from hybridrec.pipeline.events.synthetic_events import (
    EventLogConfig,
    generate_events,
    spec_text,
    split_by_time,
)
from hybridrec.pipeline.follow import FollowConfig, follow
from hybridrec.pipeline.metadata import read_dataset

REPO_ROOT = Path(__file__).resolve().parents[2]
FILES = 6


def event_stream_inputs(root: Path, files: int = FILES, config: EventLogConfig | None = None):
    """A generated event log cut in time order: the reference dataset (its first 60%,
    preprocessed) and the rest as `files` stream files under root/staged/."""
    root.mkdir(parents=True, exist_ok=True)
    config = config or EventLogConfig(users=500, items=300, topics=8, mean_events=14, seed=5)
    generate_events(root / "all.csv", root / "items.csv", config, quiet=True)
    (root / "events.toml").write_text(spec_text("items.csv"))
    (root / "staged").mkdir()
    staged = [root / "staged" / f"events-{i:03d}.csv" for i in range(files)]
    split_by_time(root / "all.csv", root / "reference.csv", staged, fraction=0.6)
    settings = PreprocessConfig(
        inputs=[str(root / "reference.csv")],
        output=str(root / "reference"),
        spec=str(root / "events.toml"),
    )
    run_event_preprocess(settings, quiet=True, beam_args=["--direct_running_mode=in_memory"])
    return root / "reference", staged


def arrive(path: Path, inputs: Path) -> Path:
    """A stream file arrives the way the producer contract asks: renamed into place."""
    inputs.mkdir(exist_ok=True)
    os.replace(path, inputs / path.name)
    return inputs / path.name


@pytest.fixture(scope="module")
def stream_inputs(tmp_path_factory):
    return event_stream_inputs(tmp_path_factory.mktemp("event_follow"))


def _config(inputs: Path, out: Path, reference: Path) -> FollowConfig:
    return FollowConfig(
        inputs=[str(inputs / "*.csv")],
        output=str(out),
        reference=str(reference),
        poll_interval=0.05,
        settle_seconds=0.0,
    )


def _copy_staged(staged: list[Path], directory: Path) -> list[Path]:
    directory.mkdir()
    copies = []
    for path in staged:
        copies.append(directory / path.name)
        copies[-1].write_bytes(path.read_bytes())
    return copies


def _raw_events(paths: list[Path]) -> dict[str, list[tuple[int, str]]]:
    """Each raw user's (file index, raw item) events, in time order (files in order,
    then times, then lines)."""
    users: dict[str, list[tuple[int, int, int, str]]] = {}
    for index, path in enumerate(paths):
        for line_number, line in enumerate(path.read_text().splitlines()[1:]):
            user, item, stamp = line.split(",")[:3]
            users.setdefault(user, []).append((index, int(stamp), line_number, item))
    return {user: [(e[0], e[-1]) for e in sorted(events)] for user, events in users.items()}


def _user_id(raw: str) -> int:
    """A raw user id hashed as the event job does (table "user", prefix 2 of 8 bits)."""
    hashed = hashing.hash_bytes_list([raw.encode()])
    return int(hashing.feature_ids(hashed, np.zeros(1, bool), 2, 8)[0])


def _rows(out: Path) -> list[dict]:
    rows = []
    for entry in read_manifest(out):
        if entry.is_shard:
            rows += pq.read_table(out / entry.shard).to_pylist()
    return rows


def test_stream_rows_continue_each_users_history_and_count_each_event_once(tmp_path, stream_inputs):
    reference, staged = stream_inputs
    staged = _copy_staged(staged, tmp_path / "staged")
    inputs, out = tmp_path / "in", tmp_path / "stream"
    for path in staged:
        arrive(path, inputs)
    summary = follow(_config(inputs, out, reference), max_idle=0.3, quiet=True)
    entries = read_manifest(out)
    assert summary.files == FILES == len(entries) and all(e.is_shard for e in entries)
    meta = read_dataset(out)
    assert meta.kind == "events" and meta.raw["stream"]["reference"] == str(reference.resolve())
    ids, names = meta.item_names()
    name_of = dict(zip(ids.tolist(), (n.decode() for n in names.to_pylist()), strict=True))
    ref_users = set(pq.read_table(reference / "test").column("user").to_pylist())
    ref_raw = _raw_events([reference.parent / "reference.csv"])
    stream_raw = _raw_events([inputs / p.name for p in staged])
    max_length = meta.raw["spec"]["max_length"]
    # every stream event is a target once, except a new user's first (history only)
    rows = _rows(out)
    targets = sum(len(r["items"]) - r["first_target"] for r in rows if len(r["items"]) > 1)
    assert targets == sum(e.raw["targets"] for e in entries)
    assert sum(e.raw["events"] for e in entries) == sum(map(len, stream_raw.values()))
    # a user's last row: the last max_length events before the user's last file (the
    # reference's, for users it kept), then the events of that file
    last = {row["user"]: row for row in rows}
    assert len(last) == len(stream_raw)
    from_reference = 0
    for raw_user, stream_events in stream_raw.items():
        row = last[_user_id(raw_user)]
        in_reference = row["user"] in ref_users
        full = [item for _, item in (ref_raw[raw_user] if in_reference else []) + stream_events]
        new = sum(index == stream_events[-1][0] for index, _ in stream_events)
        history = min(len(full) - new, max_length)
        assert [name_of[i] for i in row["items"]] == full[len(full) - new - history :]
        assert row["first_target"] == max(history, 1)
        from_reference += in_reference
    assert from_reference > 0
    new_items = sum(e.raw.get("new_items", 0) for e in entries)
    assert len(ids) == meta.raw["item_names"]["rows"] + new_items


def test_kill_9_and_restart_give_the_rows_and_state_of_an_uninterrupted_run(
    tmp_path, stream_inputs
):
    reference, staged = stream_inputs
    # uninterrupted
    clean_in, clean_out = tmp_path / "clean_in", tmp_path / "clean"
    for path in _copy_staged(staged, tmp_path / "a"):
        arrive(path, clean_in)
    follow(_config(clean_in, clean_out, reference), max_idle=0.3, quiet=True)
    # killed with -9 after some files, a torn line left, then restarted
    inputs, out = tmp_path / "in", tmp_path / "stream"
    for path in _copy_staged(staged, tmp_path / "b"):
        arrive(path, inputs)
    command = [
        sys.executable, "-m", "hybridrec", "preprocess", "--follow", "--quiet",
        "--input", str(inputs / "*.csv"), "--output", str(out), "--stats", str(reference),
        "--poll-interval", "0.05", "--settle-seconds", "0", "--max-files-per-run", "1",
        "--snapshot-every", "2",
    ]  # fmt: skip
    follower = subprocess.Popen(command, cwd=REPO_ROOT, stderr=subprocess.PIPE)
    manifest = out / "manifest.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if manifest.exists() and manifest.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.01)
    follower.send_signal(signal.SIGKILL)
    follower.wait()
    killed_at = len(read_manifest(out))
    assert killed_at >= 3, follower.stderr.read().decode()[-2000:]
    if killed_at < FILES:  # a torn line and the uncommitted file's outputs
        (out / "shards" / f"part-{killed_at:06d}.parquet").write_bytes(b"half")
        (out / "items" / f"items-{killed_at:06d}.parquet").write_bytes(b"half")
        with manifest.open("ab") as handle:
            handle.write(b'{"seq": %d, "kind": "sh' % killed_at)
    follow(_config(inputs, out, reference), max_idle=0.3, quiet=True)
    entries, clean = read_manifest(out), read_manifest(clean_out)
    assert [Path(e.source).name for e in entries] == [Path(e.source).name for e in clean]
    for mine, theirs in zip(entries, clean, strict=True):
        assert pq.read_table(out / mine.shard).equals(pq.read_table(clean_out / theirs.shard))
        assert {k: v for k, v in mine.raw.items() if k in ("rows", "targets", "events")} == {
            k: v for k, v in theirs.raw.items() if k in ("rows", "targets", "events")
        }
    assert sorted(p.name for p in (out / "shards").iterdir()) == sorted(
        Path(e.shard).name for e in entries
    )
    states = sorted((out / "state").glob("state-*.arrow"))
    assert [p.name for p in states] == [f"state-{len(entries):06d}.arrow"]


def test_a_resent_file_is_all_duplicates_and_a_click_log_file_a_dead_letter(
    tmp_path, stream_inputs
):
    reference, staged = stream_inputs
    inputs, out = tmp_path / "in", tmp_path / "stream"
    first = _copy_staged(staged[:1], tmp_path / "a")[0]
    data = first.read_bytes()
    arrive(first, inputs)
    follow(_config(inputs, out, reference), max_idle=0.2, quiet=True)
    (tmp_path / "again.csv").write_bytes(data)  # the producer sends it again, renamed
    arrive(tmp_path / "again.csv", inputs)
    (tmp_path / "clicks.csv").write_text("1\t0.5\tabc\n0\t0.1\tdef\n")
    arrive(tmp_path / "clicks.csv", inputs)
    (tmp_path / "empty.csv").write_text("")
    arrive(tmp_path / "empty.csv", inputs)
    summary = follow(_config(inputs, out, reference), max_idle=0.2, quiet=True)
    entries = {Path(e.source).name: e for e in read_manifest(out)}
    again = entries["again.csv"]
    assert again.is_shard and again.rows == 0 and again.raw["events"] == 0
    assert again.raw["duplicates"] == entries[first.name].raw["events"]
    reasons = dict(summary.dead_letters)
    clicks = reasons[str(inputs / "clicks.csv")]
    assert "header does not match" in clicks and "clicks.csv" in clicks
    assert "empty file" in reasons[str(inputs / "empty.csv")]
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["splits"] == {} and meta["kind"] == "events"
