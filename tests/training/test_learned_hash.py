"""Learned id -> bucket mappings (training.learned_hash) and `hybridrec learn-hash`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hybridrec.common.errors import UserError
from hybridrec.pipeline.id_map import ARRAYS_FILE, IdMap, read_id_map, write_id_map
from hybridrec.training.learned.hash_map import build_feature_map

PREFIX_BITS = 8


def _feature(prefix: int, low: np.ndarray) -> np.ndarray:
    return (np.uint64(prefix) << np.uint64(64 - PREFIX_BITS)) | low.astype(np.uint64)


def test_frequent_ids_keep_rows_of_their_own_and_similar_tail_ids_share():
    """10 ids by descending count, a budget of 4: the 2 most frequent alone; the tail's two
    clusters of embeddings (around +1 and -1) each in a bucket of its own."""
    ids = _feature(3, np.arange(1, 11))
    counts = np.array([100, 90, 5, 5, 5, 5, 5, 5, 5, 5])
    rng = np.random.default_rng(0)
    side = np.array([0, 0, 1, -1, 1, -1, 1, -1, 1, -1], np.float32)
    vectors = side[:, None] * np.ones((10, 8), np.float32) + rng.normal(0, 0.05, (10, 8))
    feature = build_feature_map(ids, counts, vectors.astype(np.float32), fraction=0.4)
    assert feature.num_buckets == 4 and feature.exclusive == 2
    bucket = dict(zip(feature.ids.tolist(), feature.buckets.tolist(), strict=True))
    assert {bucket[int(ids[0])], bucket[int(ids[1])]} == {0, 1}
    positive = {bucket[int(i)] for i, s in zip(ids[2:], side[2:], strict=True) if s > 0}
    negative = {bucket[int(i)] for i, s in zip(ids[2:], side[2:], strict=True) if s < 0}
    assert len(positive) == 1 and len(negative) == 1 and positive != negative
    assert positive | negative == {2, 3}


def test_a_budget_above_the_ids_gives_every_id_its_own_bucket():
    ids = _feature(1, np.array([7, 3, 9]))
    feature = build_feature_map(
        ids, np.array([3, 2, 1]), np.zeros((3, 4), np.float32), fraction=1.0
    )
    assert sorted(feature.buckets.tolist()) == [0, 1, 2] and feature.num_buckets == 3


def test_mapped_ids_keep_the_feature_prefix_and_stay_within_the_budget(tmp_path):
    seen = _feature(2, np.arange(1, 101))
    counts = np.arange(100, 0, -1)
    vectors = np.random.default_rng(1).normal(size=(100, 4)).astype(np.float32)
    feature = build_feature_map(seen, counts, vectors, fraction=0.2)
    write_id_map(tmp_path, {"site": feature}, prefix_bits=PREFIX_BITS, source={"test": 1})
    unseen = _feature(2, np.arange(1000, 1500))
    for kind in ("learned", "hashing_trick"):
        id_map = read_id_map(tmp_path, kind)
        for ids in (seen, unseen):
            mapped = id_map.map_ids("site", ids)
            assert np.all(mapped >> np.uint64(64 - PREFIX_BITS) == 2)
            low = mapped & np.uint64((1 << (64 - PREFIX_BITS)) - 1)
            assert low.min() >= 1 and low.max() <= feature.num_buckets  # bucket + 1
        assert len(np.unique(id_map.map_ids("site", seen))) > 10
    learned = read_id_map(tmp_path, "learned").map_ids("site", seen)
    exclusive = learned[: feature.exclusive]  # the most frequent ids: one row each
    assert len(np.unique(exclusive)) == feature.exclusive
    assert not np.isin(exclusive, learned[feature.exclusive :]).any()
    unseen_low = read_id_map(tmp_path).map_ids("site", unseen) & np.uint64(0xFFFF)
    assert unseen_low.min() > feature.exclusive  # unseen ids hash into the tail only
    untouched = _feature(5, np.arange(3))
    assert np.array_equal(read_id_map(tmp_path).map_ids("other", untouched), untouched)


def test_a_corrupt_or_missing_map_is_named(tmp_path):
    with pytest.raises(UserError, match="hybridrec learn-hash"):
        read_id_map(tmp_path / "none")
    feature = build_feature_map(
        _feature(1, np.arange(1, 9)), np.ones(8), np.zeros((8, 2), np.float32), fraction=0.5
    )
    write_id_map(tmp_path, {"f": feature}, prefix_bits=PREFIX_BITS, source={})
    data = bytearray((tmp_path / ARRAYS_FILE).read_bytes())
    data[-20] ^= 0xFF
    (tmp_path / ARRAYS_FILE).write_bytes(bytes(data))
    with pytest.raises(UserError, match="checksum mismatch"):
        read_id_map(tmp_path)
    with pytest.raises(UserError, match="id_map_kind"):
        IdMap({}, PREFIX_BITS, "random")


def test_learn_hash_from_a_run_then_train_within_the_budget(
    dataset, small_model, training, cli, tmp_path
):
    """A run trains; learn-hash counts its training ids (Beam) and reads its embeddings;
    training with the map holds at most the map's rows, learned or hashed."""
    source = tmp_path / "source"
    cli(*training.args(dataset, source, "--quiet", *small_model("data.max_steps=20")))
    out = tmp_path / "map"
    learned = cli("learn-hash", "--run", str(source), "--out", str(out), "--fraction", "0.1")
    assert "rows (10%)" in learned.stdout
    description = json.loads((out / "id_map.json").read_text())
    budget = sum(feature["buckets"] for feature in description["features"])
    seen = sum(feature["ids"] for feature in description["features"])
    assert 0.09 * seen <= budget <= 0.1 * seen + len(description["features"])
    for kind in ("learned", "hashing_trick"):
        run = tmp_path / kind
        settings = [
            f'embedding.id_map="{out}"',
            f'embedding.id_map_kind="{kind}"',
            "data.max_steps=20",
        ]
        result = cli(*training.args(dataset, run, *small_model(*settings)))
        assert f"id map: {kind} mapping of {out}" in result.stdout
        summary = json.loads((run / "summary.json").read_text())
        assert 0 < summary["embedding_store"]["rows"] <= budget
        assert summary["eval"]["auc"] > 0.5
    # the export carries the map: served ids find the rows the run trained (without the
    # map almost every id would be unseen and get a default row)
    from hybridrec.serving import ServedModel

    cli("export", "--run", str(tmp_path / "learned"), "--out", str(tmp_path / "export"))
    model = ServedModel(tmp_path / "export")
    lines = (dataset.parent / "raw.tsv").read_text().splitlines()[:200]
    ids, dense = model.encode_rows(lines)
    probabilities, unseen = model.predict(ids, dense)
    assert np.all((probabilities > 0) & (probabilities < 1))
    model.id_map = None  # as if the export had no map: raw ids against bucket rows
    _, unmapped_unseen = model.predict(ids, dense)
    assert unseen.sum() < 0.5 * unmapped_unseen.sum(), (unseen.sum(), unmapped_unseen.sum())
    model.close()
