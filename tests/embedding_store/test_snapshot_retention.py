"""The store owns its snapshot files: listing, discarding and pruning through its API,
the same on a local path and on another kvstore (memory://)."""

import os

import numpy as np
import pytest
from hybridrec.embedding_store import EmbeddingStore, TableConfig, checkpoint

IDS = np.arange(500, dtype=np.uint64)


def _train(store, step):
    store.set_step(step)
    rng = np.random.default_rng(step)
    ids = rng.choice(IDS, size=64, replace=False)
    store.lookup("items", ids)
    store.apply_gradients("items", ids, rng.normal(size=(64, 4)).astype(np.float32))
    store.flush()


def _rows(store):
    return store.lookup("items", IDS, train=False).result()


@pytest.fixture(params=["path", "memory"])
def url(request, tmp_path):
    if request.param == "path":
        return str(tmp_path / "embeddings")
    return f"memory://retention-{id(request)}/"


def test_prune_keeps_the_newest_snapshots_and_the_chains_they_read(url):
    tables = [TableConfig(name="items", dim=4, capacity=10_000)]
    store = EmbeddingStore(tables, num_shards=2)
    kept_rows = {}
    for step in range(1, 8):
        _train(store, step)
        # incremental snapshots, with a full one at step 4: chains {1,2,3} and {4,5,6,7}
        store.checkpoint(url, step, full=step in (1, 4))
        kept_rows[step] = _rows(store)
    assert checkpoint.committed_steps(url) == list(range(1, 8))
    assert checkpoint.snapshot_groups(url) == list(range(1, 8))

    assert checkpoint.prune(url, keep=2) == [1, 2, 3, 4, 5]
    assert checkpoint.committed_steps(url) == [6, 7]
    # 6 and 7 are rebuilt from the groups of 4, 5 (full at 4): those stay, 1-3 go
    assert checkpoint.snapshot_groups(url) == [4, 5, 6, 7]
    for step in (6, 7):
        with EmbeddingStore.restore(url, tables, step=step, num_shards=3) as restored:
            np.testing.assert_array_equal(_rows(restored), kept_rows[step])
    assert checkpoint.prune(url, keep=2) == []  # nothing more to do
    store.close()


def test_discard_after_removes_newer_snapshots_committed_or_not(url):
    tables = [TableConfig(name="items", dim=4, capacity=10_000)]
    store = EmbeddingStore(tables, num_shards=1)
    for step in (1, 2, 3):
        _train(store, step)
        store.checkpoint(url, step)
    assert checkpoint.discard_after(url, 1) == [2, 3]
    assert checkpoint.committed_steps(url) == [1]
    assert checkpoint.snapshot_groups(url) == [1]
    store.close()


def test_a_manifest_write_killed_midway_does_not_corrupt_the_next_one(tmp_path):
    """A writer killed inside the manifest's write leaves its lock file holding a partial,
    longer manifest; a resumed run's manifest of the same step must read back whole."""
    url = str(tmp_path / "embeddings")
    tables = [TableConfig(name="items", dim=4, capacity=10_000)]
    store = EmbeddingStore(tables, num_shards=1)
    for step in (1, 2):
        _train(store, step)
        store.checkpoint(url, step)
    stale = os.path.join(url, checkpoint.manifest_key(3) + ".__lock")
    with open(stale, "wb") as handle:
        handle.write(b"{" + b" " * 20_000)  # what the killed writer got out
    checkpoint.discard_after(url, 2)  # the resumed run restarts from step 2
    assert not os.path.exists(stale)
    _train(store, 3)
    store.checkpoint(url, 3)
    assert checkpoint.read_manifest(url, 3)["step"] == 3
    store.close()
