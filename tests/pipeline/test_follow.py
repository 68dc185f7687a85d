"""Follow mode: complete files -> shards + manifest, bad files -> dead letters, restarts idempotent."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hybridrec.pipeline import (
    PreprocessConfig,
    RowEncoder,
    load_spec,
    read_manifest,
    run_preprocess,
)
from hybridrec.pipeline.follow import FileWatcher, FollowConfig, follow
from hybridrec.pipeline.synthetic import generate_block

REPO_ROOT = Path(__file__).resolve().parents[2]


def _drop(directory: Path, name: str, data: bytes) -> Path:
    """Writes `name` the way the producer contract asks: a hidden name, then a rename."""
    temporary = directory / f".{name}.writing"
    temporary.write_bytes(data)
    os.replace(temporary, directory / name)
    return directory / name


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reference")
    (root / "logs.tsv").write_bytes(generate_block(0, 0, 400)[0])
    config = PreprocessConfig(inputs=[str(root / "logs.tsv")], output=str(root / "data"))
    run_preprocess(config, beam_args=["--direct_num_workers=1"], quiet=True)
    return root / "data"


def _config(inputs: Path, out: Path, reference: Path, **extra) -> FollowConfig:
    timings = {"poll_interval": 0.05, "settle_seconds": 0.1, **extra}
    return FollowConfig(
        inputs=[str(inputs / "*.tsv"), str(inputs / "*.gz")],
        output=str(out),
        reference=str(reference),
        **timings,
    )


def test_follow_commits_complete_files_and_dead_letters_bad_ones(tmp_path, reference):
    inputs = tmp_path / "in"
    inputs.mkdir()
    good = {f"good{i}.tsv": generate_block(1, i, 150 + 50 * i)[0] for i in range(2)}
    for name, data in good.items():
        _drop(inputs, name, data)
    _drop(inputs, "empty.tsv", b"")
    _drop(inputs, "other_schema.tsv", b"user,item,clicked\n7,8,1\n9,10,0\n")
    whole = gzip.compress(generate_block(2, 0, 300)[0])
    _drop(inputs, "truncated.tsv.gz", whole[: len(whole) // 2])
    growing = inputs / "growing.tsv"
    growing.write_bytes(generate_block(3, 0, 5)[0])
    done = threading.Event()

    def keep_writing():  # a producer that never finishes its file
        while not done.wait(0.02):
            with growing.open("ab") as handle:
                handle.write(generate_block(3, 1, 1)[0])

    writer = threading.Thread(target=keep_writing)
    writer.start()
    try:
        out = tmp_path / "stream"
        # the good files settle; the growing one changes every 0.02 s, never for 0.6 s
        config = _config(inputs, out, reference, settle_seconds=0.6, grow_timeout=1.5)
        summary = follow(config, max_idle=2.0, quiet=True)
    finally:
        done.set()
        writer.join()

    entries = read_manifest(out)
    assert [entry.seq for entry in entries] == list(range(6))
    shards = {Path(e.source).name: e for e in entries if e.is_shard}
    assert set(shards) == set(good)
    letters = {Path(e.source).name: e.reason for e in entries if not e.is_shard}
    assert set(letters) == {"empty.tsv", "other_schema.tsv", "truncated.tsv.gz", "growing.tsv"}
    assert "empty file" in letters["empty.tsv"]
    assert "every row rejected" in letters["other_schema.tsv"]
    assert "truncated" in letters["truncated.tsv.gz"]
    assert "still growing" in letters["growing.tsv"]
    for entry in entries:
        if not entry.is_shard:
            copy = out / entry.raw["copy"]
            assert copy.exists()
            assert Path(f"{copy}.reason.txt").read_text().strip() == entry.reason
    assert summary.files == 2 and summary.rows == 150 + 200
    assert len(summary.dead_letters) == 4

    # the frozen reference transforms: a shard holds what serving's encoder makes of the rows
    encoder = RowEncoder(load_spec("criteo"))
    for name, data in good.items():
        table = pq.read_table(out / shards[name].shard)
        encoded = encoder.encode(data.splitlines())
        assert table.num_rows == shards[name].rows == len(data.splitlines())
        np.testing.assert_array_equal(table.column("C3").to_numpy(), encoded.ids["C3"])
        np.testing.assert_allclose(table.column("I2").to_numpy(), encoded.dense[:, 1])
    assert not list((out / "_temporary").glob("*"))


def test_half_written_file_waits_for_its_marker_and_for_settling(tmp_path, reference):
    inputs = tmp_path / "in"
    inputs.mkdir()
    config = _config(inputs, tmp_path / "out", reference, marker_suffix=".done", settle_seconds=0.2)
    watcher = FileWatcher(config, done=set())
    (inputs / "a.tsv").write_bytes(generate_block(4, 0, 3)[0])
    now = time.monotonic()
    assert watcher.poll(now) == ([], [])
    assert watcher.poll(now + 1.0) == ([], [])  # settled, but no marker yet
    (inputs / "a.tsv.done").touch()
    ready, overdue = watcher.poll(now + 1.1)
    assert ready == [str(inputs / "a.tsv")] and overdue == []

    plain = FileWatcher(_config(inputs, tmp_path / "out", reference, settle_seconds=5.0), set())
    with (inputs / "b.tsv").open("wb") as handle:  # modified just now: not settled
        handle.write(generate_block(4, 1, 3)[0])
    ready, _ = plain.poll(time.monotonic())
    assert str(inputs / "b.tsv") not in ready


def test_restart_after_kill_9_commits_every_file_once(tmp_path, reference):
    inputs, out = tmp_path / "in", tmp_path / "stream"
    inputs.mkdir()
    expected = {}
    for index in range(12):
        data = generate_block(5, index, 40 + index)[0]
        expected[str(_drop(inputs, f"part{index:02d}.tsv", data))] = 40 + index
    command = [
        sys.executable, "-m", "hybridrec", "preprocess", "--follow", "--quiet",
        "--input", str(inputs / "*.tsv"), "--output", str(out), "--stats", str(reference),
        "--poll-interval", "0.05", "--settle-seconds", "0", "--max-files-per-run", "1",
    ]  # fmt: skip
    follower = subprocess.Popen(command, cwd=REPO_ROOT, stderr=subprocess.PIPE)
    manifest = out / "manifest.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if manifest.exists() and manifest.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.02)
    follower.send_signal(signal.SIGKILL)
    follower.wait()
    killed_at = len(read_manifest(out))
    assert killed_at >= 3, follower.stderr.read().decode()[-2000:]
    # a torn last line, and the shard of that uncommitted file, as a kill mid-commit leaves them
    seq = killed_at
    (out / "shards" / f"part-{seq:06d}.parquet").write_bytes(b"half a shard")
    with manifest.open("ab") as handle:
        handle.write(b'{"seq": %d, "kind": "sha' % seq)

    follow(_config(inputs, out, reference, settle_seconds=0.0), max_idle=0.5, quiet=True)

    entries = read_manifest(out)
    assert manifest.read_bytes().endswith(b"\n")
    sources = [entry.source for entry in entries]
    assert sorted(sources) == sorted(expected)  # every file once: none lost, none twice
    assert all(entry.is_shard and entry.rows == expected[entry.source] for entry in entries)
    on_disk = sorted(path.name for path in (out / "shards").glob("*.parquet"))
    assert on_disk == sorted(Path(entry.shard).name for entry in entries)
    for entry in entries:
        assert pq.read_metadata(out / entry.shard).num_rows == entry.rows
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["stream"]["manifest"] == "manifest.jsonl"


def test_follow_refuses_a_stream_of_another_reference_spec(tmp_path, reference):
    out = tmp_path / "stream"
    follow(_config(tmp_path, out, reference), max_idle=0.1, quiet=True)
    meta = json.loads((out / "metadata.json").read_text())
    meta["spec"]["dense"] = meta["spec"]["dense"][:-1]
    (out / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(Exception, match="another spec"):
        follow(_config(tmp_path, out, reference), max_idle=0.1, quiet=True)
