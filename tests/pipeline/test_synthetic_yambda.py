"""The Yambda-shaped generator (`hybridrec generate --events --profile yambda`): its files
and their shape, that the same arguments make the same bytes, that what it reports as
learnable is (the label follows affinity, organic listens and the user x artist pair),
that its blocks are bounded in events, and that its spec preprocesses into histories."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow.csv as pacsv
import pytest
from hybridrec.pipeline.config import PreprocessConfig
from hybridrec.pipeline.events.event_job import run_event_preprocess
from hybridrec.pipeline.events.synthetic_yambda import (
    ALBUM_TRACKS,
    BLOCK_EVENTS,
    EVENT_TYPES,
    YambdaConfig,
    generate_yambda,
    yambda_spec_text,
)

CONFIG = YambdaConfig(users=1500, tracks=6000, mean_events=80, seed=3)


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    root = tmp_path_factory.mktemp("yambda")
    summary = generate_yambda(root / "events.csv", root / "tracks.csv", CONFIG, progress=False)
    (root / "events.toml").write_text(yambda_spec_text("tracks.csv"))
    events = pacsv.read_csv(root / "events.csv").to_pydict()
    tracks = pacsv.read_csv(root / "tracks.csv").to_pydict()
    return root, summary, {k: np.asarray(v) for k, v in events.items()}, tracks


def test_the_files_have_yambdas_columns_and_shape(log):
    _, summary, events, tracks = log
    assert list(events) == [
        "uid", "item_id", "timestamp", "is_organic", "event_type", "played_ratio_pct"
    ]  # fmt: skip
    assert summary["events"] == len(events["uid"]) and summary["users"] == CONFIG.users
    assert set(events["event_type"]) == set(EVENT_TYPES)
    listen = events["event_type"] == "listen"
    played = events["played_ratio_pct"]
    assert np.isnan(played[~listen].astype(float)).all()  # only listens are played
    assert ((played[listen] >= 0) & (played[listen] <= 99)).all()
    assert 0.85 < listen.mean() < 0.95 and abs(events["is_organic"].mean() - 0.5) < 0.02
    # users one after another, each one's events in time order
    uid, times = events["uid"], events["timestamp"]
    assert (np.diff(uid) >= 0).all() and (np.diff(times)[np.diff(uid) == 0] >= 0).all()
    assert times.max() - times.min() <= CONFIG.days * 86400
    # tracks: each album one artist's, at most ALBUM_TRACKS tracks; every event's track known
    artist, album = np.asarray(tracks["artist_id"]), np.asarray(tracks["album_id"])
    assert len(artist) == CONFIG.tracks and artist.max() + 1 == CONFIG.tracks // 10
    first_artist = {}
    for a, b in zip(artist, album, strict=True):
        assert first_artist.setdefault(b, a) == a
    assert np.bincount(album).max() <= ALBUM_TRACKS
    assert events["item_id"].max() < CONFIG.tracks


def test_the_same_arguments_make_the_same_bytes(log, tmp_path):
    root = log[0]
    generate_yambda(tmp_path / "e.csv", tmp_path / "t.csv", CONFIG, progress=False)
    assert (tmp_path / "e.csv").read_bytes() == (root / "events.csv").read_bytes()
    assert (tmp_path / "t.csv").read_bytes() == (root / "tracks.csv").read_bytes()
    other = dataclasses.replace(CONFIG, users=50, seed=4)  # another seed: other events
    generate_yambda(tmp_path / "o.csv", tmp_path / "ot.csv", other, progress=False)
    ours = dataclasses.replace(CONFIG, users=50)
    generate_yambda(tmp_path / "s.csv", tmp_path / "st.csv", ours, progress=False)
    assert (tmp_path / "o.csv").read_bytes() != (tmp_path / "s.csv").read_bytes()


def test_what_it_reports_learnable_is(log):
    _, summary, events, tracks = log
    assert 0.75 < summary["oracle_auc"] < 0.95  # above DLRMv4's quality target, below 1
    listen = events["event_type"] == "listen"
    label = events["played_ratio_pct"][listen].astype(float) >= 50
    assert abs(label.mean() - summary["listen_plus_rate"]) < 1e-9
    organic = events["is_organic"][listen] == 1
    assert label[organic].mean() > label[~organic].mean() + 0.1
    # the user x artist pair: its listens' labels agree between their halves
    artist = np.asarray(tracks["artist_id"])[events["item_id"][listen]]
    pair = events["uid"][listen].astype(np.int64) * 10**6 + artist
    rank = np.zeros(len(pair), np.int64)  # each listen's place among its pair's
    order = np.argsort(pair, kind="stable")
    starts = np.r_[0, np.flatnonzero(np.diff(pair[order])) + 1]
    sizes = np.diff(np.r_[starts, len(order)])
    rank[order] = np.arange(len(order)) - np.repeat(starts, sizes)
    keys, inverse = np.unique(pair, return_inverse=True)
    halves = []
    for part in (rank % 2 == 0, rank % 2 == 1):
        total = np.bincount(inverse[part], label[part], minlength=len(keys))
        count = np.bincount(inverse[part], minlength=len(keys))
        halves.append((total, count))
    both = (halves[0][1] >= 3) & (halves[1][1] >= 3)
    first, second = (t[both] / c[both] for t, c in halves)
    assert both.sum() > 200 and np.corrcoef(first, second)[0, 1] > 0.3


def test_blocks_are_bounded_in_events():
    assert YambdaConfig(mean_events=200).block_users * 200 <= BLOCK_EVENTS
    assert YambdaConfig(mean_events=10**7, max_events=10**7).block_users == 1
    with pytest.raises(ValueError, match="organic is a share"):
        YambdaConfig(organic=1.5)


def test_its_spec_preprocesses_into_histories(log, tmp_path):
    root = log[0]
    settings = PreprocessConfig(
        inputs=[str(root / "events.csv")], output=str(tmp_path / "data"), spec=str(root / "events.toml")
    )  # fmt: skip
    run_event_preprocess(settings, quiet=True, beam_args=["--direct_running_mode=in_memory"])
    metadata = json.loads((tmp_path / "data" / "metadata.json").read_text())
    assert metadata["kind"] == "events"
    assert metadata["spec"]["action"]["values"] == list(EVENT_TYPES)
    assert metadata["spec"]["items"]["features"] == ["artist_id", "album_id"]
    assert {"train", "valid", "test"} <= set(metadata["splits"])


def test_the_command_writes_the_three_files_and_says_what_is_learnable(tmp_path, capsys):
    from hybridrec import cli

    out = tmp_path / "yambda"
    args = ["generate", "--events", "--profile", "yambda", "-o", str(out)]
    assert cli.main([*args, "--users", "40", "--items", "500", "--mean-events", "20"]) == 0
    printed = capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == {"events.csv", "tracks.csv", "events.toml"}
    assert "oracle    AUC 0." in printed and "500 tracks (50 artists" in printed
    # bad input: one line each, nothing written
    with pytest.raises(SystemExit):
        cli.main(["generate", "--profile", "yambda", "-o", str(tmp_path / "no")])
    assert "give --events too" in capsys.readouterr().err
    assert cli.main([*args[:-1], str(tmp_path / "none"), "--users", "0"]) != 0
    assert "users, tracks and days must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "no").exists() and not (tmp_path / "none").exists()
