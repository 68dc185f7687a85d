"""train --follow on an event stream: every new event trained once across a kill -9, each
file evaluated before it is trained (window T -> T+1), exports that serve the new items."""

from __future__ import annotations

import json
import signal
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
from hybridrec.pipeline import read_shards
from hybridrec.pipeline.follow import FollowConfig, follow
from hybridrec.training.sequences.batches import Histories
from hybridrec.training.sequences.packing import stream_pieces

from tests.pipeline.test_event_follow import arrive, event_stream_inputs
from tests.training.test_cli_errors import _fails
from tests.training.test_online import _position
from tests.training.test_sequence_training import sets


def test_stream_pieces_cover_every_target_once_newest_positions_whole():
    # histories of 12, 5, 3 and 1 items; targets from positions 8, 1 (a new user), 3, -
    items = np.arange(21, dtype=np.uint64)
    offsets = np.array([0, 12, 17, 20, 21])
    histories = Histories(items, offsets, np.array([9, 1, 2, 1]))
    pieces = stream_pieces(histories, 4)
    got = list(zip(pieces.history.tolist(), pieces.start.tolist(), pieces.stop.tolist(), strict=True))  # fmt: skip
    # history 0: positions 0..10, targets at 8..10 -> the newest 4 positions [7, 11);
    # history 1: positions 0..3 all targets -> [0, 4); history 2: positions 0..1, target at 1
    assert got == [(0, 7, 11), (1, 0, 4), (2, 0, 2)]
    long = Histories(np.arange(11, dtype=np.uint64), np.array([0, 11]), np.array([2]))
    cut = stream_pieces(long, 4)  # targets at positions 1..9: three pieces from the end
    assert list(zip(cut.start.tolist(), cut.stop.tolist(), strict=True)) == [
        (0, 2),
        (2, 6),
        (6, 10),
    ]


@pytest.fixture(scope="module")
def stream_inputs(tmp_path_factory):
    return event_stream_inputs(tmp_path_factory.mktemp("sequence_online"), files=6)


def test_kill_9_then_resume_trains_every_event_once_and_evaluates_each_window(
    tmp_path, stream_inputs, training, cli
):
    reference, staged = stream_inputs
    inputs, stream, run_dir, export = (tmp_path / n for n in ("in", "stream", "run", "export"))
    config = FollowConfig(
        inputs=[str(inputs / "*.csv")],
        output=str(stream),
        reference=str(reference),
        poll_interval=0.05,
        settle_seconds=0.0,
    )
    copies = []
    for path in staged:
        copies.append(tmp_path / path.name)
        copies[-1].write_bytes(path.read_bytes())
    for path in copies[:3]:
        arrive(path, inputs)
    follow(config, max_idle=0.2, quiet=True)

    flags = [
        "train", "--follow", str(stream), "--run-dir", str(run_dir), "--config", "sasrec",
        *sets("data.batch_size=8", "data.token_budget=0", "hybrid.staleness=2"),
        "--checkpoint-every", "0.2", "--flush-after", "0.3", "--quiet", "--export", str(export),
    ]  # fmt: skip
    first = training.start(*flags)
    training.wait_for_checkpoint(first, run_dir, 3)
    first.send_signal(signal.SIGKILL)
    first.wait()
    killed_at = training.last_step(run_dir)

    for path in copies[3:]:  # the stream goes on while the trainer is down
        arrive(path, inputs)
    follow(config, max_idle=0.2, quiet=True)
    shards = read_shards(stream)
    targets = {str(i): entry.raw["targets"] for i, entry in enumerate(shards)}
    second = training.start(*flags, "--resume", "--publish-every", "0.5")
    deadline = time.monotonic() + 180
    while True:
        step = training.last_step(run_dir)
        if step and _position(run_dir, step)["rows"] >= sum(targets.values()):
            break
        assert second.poll() is None, second.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "the resumed run did not catch up"
        time.sleep(0.1)
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=120) == 0, second.stderr.read()[-3000:]

    final = training.last_step(run_dir)
    assert final > killed_at
    saved = _position(run_dir, final)
    # every new event of every shard trained once: counted batch by batch, restored with the model
    assert saved["rows_by_shard"] == targets
    assert saved["stream"]["shard"] == len(shards)
    # each shard evaluated (once it had rows) before it was trained, as a window
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = {r["window"]: r for r in records if r["kind"] == "window"}
    assert sorted(windows) == list(range(len(shards)))
    for index, record in windows.items():
        assert record["source"] == shards[index].source
        assert 0 <= record["ndcg@10"] <= record["hr@10"] <= 1
        assert record["queries"] == shards[index].raw["targets"]  # every new event ranked
    plot = cli("plot", str(run_dir)).stdout
    assert "windows.png" in plot and (run_dir / "plots" / "windows.png").stat().st_size > 0

    # the served catalogue holds the items the stream brought, by their raw ids
    from hybridrec import load_model

    served = load_model(export)
    brought = pq.read_table(stream / shards[0].raw["items_file"]).column("name").to_pylist()
    catalogue = set(np.load(next(export.glob("*/catalogue.npy"))).tolist())
    new_items = pq.read_table(stream / shards[0].raw["items_file"]).column("item").to_pylist()
    assert set(new_items) <= catalogue
    history = [brought[0].decode()]
    (top,) = served.recommend([history], k=5, actions=[["view"]])  # SASRec reads action types
    assert len(top) == 5 and all(isinstance(name, str) for name, _ in top)


def test_a_follow_run_of_the_wrong_stream_kind_ends_with_one_line(tmp_path, stream_inputs):
    reference, staged = stream_inputs
    stream = tmp_path / "stream"
    follow(
        FollowConfig(inputs=[str(tmp_path / "*.csv")], output=str(stream), reference=str(reference)),
        max_idle=0.1,
        quiet=True,
    )  # fmt: skip
    wrong = _fails("train", "--follow", str(stream), "--run-dir", str(tmp_path / "a"), "--config", "quickstart")  # fmt: skip
    assert "user histories" in wrong
    batch = _fails("train", "--data", str(stream), "--run-dir", str(tmp_path / "b"), "--config", "sasrec")  # fmt: skip
    assert "--follow" in batch and str(stream) in batch


def test_init_from_a_batch_run_on_the_reference_starts_the_stream_from_its_model(
    tmp_path, stream_inputs, cli
):
    reference, staged = stream_inputs
    stream = tmp_path / "stream"
    inputs = tmp_path / "in"
    for path in staged[:2]:
        copy = tmp_path / path.name
        copy.write_bytes(path.read_bytes())
        arrive(copy, inputs)
    follow(
        FollowConfig(
            inputs=[str(inputs / "*.csv")],
            output=str(stream),
            reference=str(reference),
            settle_seconds=0.0,
        ),  # fmt: skip
        max_idle=0.1,
        quiet=True,
    )
    batch = tmp_path / "batch"
    model = sets("data.batch_size=8", "data.token_budget=0")
    cli("train", "--data", str(reference), "--run-dir", str(batch), "--config", "sasrec", *model, *sets("data.epochs=3"), "--quiet")  # fmt: skip

    def first_window(run_dir, *extra) -> tuple[dict, str]:
        out = cli("train", "--follow", str(stream), "--run-dir", str(run_dir), "--config", "sasrec", *model, "--max-idle", "0.5", *extra).stdout  # fmt: skip
        records = (run_dir / "metrics.jsonl").read_text().splitlines()
        return next(r for r in map(json.loads, records) if r["kind"] == "window"), out

    fresh, _ = first_window(tmp_path / "fresh")
    started, out = first_window(tmp_path / "started", "--init-from", str(batch))
    assert f"initial model: {batch}, step " in out
    # the batch run's model (dense state and item rows) ranks the first file's events far
    # better than a new one
    assert started["hr@10"] > fresh["hr@10"] + 0.05, (started, fresh)
    wrong = _fails("train", "--follow", str(stream), "--run-dir", str(tmp_path / "x"), "--config", "sasrec", "--init-from", str(tmp_path / "nothing"))  # fmt: skip
    assert "nothing" in wrong and "does not exist" in wrong


def test_a_file_of_new_users_first_events_has_no_target_and_the_run_goes_on(
    tmp_path, stream_inputs, cli
):
    reference, staged = stream_inputs
    inputs, stream = tmp_path / "in", tmp_path / "stream"
    first = tmp_path / staged[0].name
    first.write_bytes(staged[0].read_bytes())
    header, line = staged[1].read_text().splitlines()[:2]
    user, item, stamp, *rest = line.split(",")
    newbies = [",".join([f"newbie-{i}", item, stamp, *rest]) for i in range(5)]
    (tmp_path / "newbies.csv").write_text("\n".join([header, *newbies]) + "\n")
    second = tmp_path / staged[1].name
    second.write_bytes(staged[1].read_bytes())
    config = FollowConfig(
        inputs=[str(inputs / "*.csv")], output=str(stream), reference=str(reference), settle_seconds=0.0
    )  # fmt: skip
    for path in (first, tmp_path / "newbies.csv", second):  # in this order: 3 shards
        arrive(path, inputs)
        follow(config, max_idle=0.1, quiet=True)
    shards = read_shards(stream)
    assert [entry.raw["targets"] for entry in shards][1] == 0 and shards[1].rows == 5
    run_dir = tmp_path / "run"
    # with an event's and an item's side feature: the shards carry their columns
    sides = 'model.sequence.side_features=["device", "category"]'
    cli("train", "--follow", str(stream), "--run-dir", str(run_dir), "--config", "sasrec", *sets("data.batch_size=8", "data.token_budget=0", sides), "--max-idle", "0.5", "--quiet")  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rows_trained"] == sum(entry.raw["targets"] for entry in shards)
    saved = json.loads((run_dir / "config.json").read_text())["model"]["sequence"]
    assert saved["side_features"] == ["device", "category"]
    records = (run_dir / "metrics.jsonl").read_text().splitlines()
    windows = sorted(r["window"] for r in map(json.loads, records) if r["kind"] == "window")
    assert windows == [0, 2]  # the file without a target is not a window
