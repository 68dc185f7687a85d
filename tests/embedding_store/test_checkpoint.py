"""Checkpoints: round trip, resharding, incremental deltas, atomicity, bad checkpoints."""

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hybridrec.embedding_store import (
    AdmissionConfig,
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointNotFoundError,
    EmbeddingStore,
    IncompatibleCheckpointError,
    LocalShard,
    SparseOptimizerConfig,
    TableConfig,
    checkpoint,
    latest_checkpoint_step,
)

REPO = Path(__file__).resolve().parents[2]


def _tables():
    return [
        TableConfig(
            name="items",
            dim=8,
            capacity=100_000,
            optimizer=SparseOptimizerConfig(name="adam", learning_rate=0.01),
            admission=AdmissionConfig(min_count=2),
        ),
        TableConfig(name="users", dim=8, capacity=100_000),  # adagrad
    ]


def _train(store, steps, seed):
    rng = np.random.default_rng(seed)
    for step in range(steps):
        store.set_step(step)
        for table in ("items", "users"):
            ids = rng.integers(0, 3000, size=512).astype(np.uint64)
            store.lookup(table, ids)
            grads = rng.normal(size=(512, 8)).astype(np.float32)
            store.apply_gradients(table, ids, grads)
    store.flush()


def _snapshot(store):
    ids = np.arange(3000, dtype=np.uint64)
    return {t: store.lookup(t, ids, train=False).result() for t in ("items", "users")}


def _assert_same(a, b):
    for table in a:
        np.testing.assert_array_equal(a[table], b[table], err_msg=table)


@pytest.mark.parametrize("url_kind", ["memory", "path", "file"])
def test_round_trip_and_reshard_4_to_3_then_training_continues_identically(tmp_path, url_kind):
    url = {
        "memory": "memory://roundtrip/",
        "path": str(tmp_path / "ckpt"),
        "file": f"file://{tmp_path}/ckpt-url",
    }[url_kind]
    with EmbeddingStore(_tables(), num_shards=4) as store:
        _train(store, 3, seed=0)
        info = store.checkpoint(url, step=3)
        assert info["full"] and info["rows_written"] == store.stats()["rows"]
        pending = store.stats()["pending_admission"]
        assert pending > 0  # admission counters are part of the state
        saved = _snapshot(store)
        _train(store, 2, seed=1)
        reference = _snapshot(store)
    assert latest_checkpoint_step(url) == 3
    for num_shards in (3, 4, 1):
        restored = EmbeddingStore.restore(url, _tables(), num_shards=num_shards)
        with restored:
            _assert_same(_snapshot(restored), saved)
            assert restored.stats()["pending_admission"] == pending
            # Optimizer state (Adam moments, Adagrad accumulators) and counters came back:
            _train(restored, 2, seed=1)
            _assert_same(_snapshot(restored), reference)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_every_optimizer_round_trips_onto_other_shard_count(tmp_path, optimizer):
    # SGD keeps no per-row state: its state array is [rows, 0] and must still be stored.
    table = TableConfig(
        name="items",
        dim=4,
        capacity=10_000,
        optimizer=SparseOptimizerConfig(name=optimizer, learning_rate=0.1),
    )
    ids = np.arange(200, dtype=np.uint64)
    grads = np.random.default_rng(0).normal(size=(200, 4)).astype(np.float32)
    with EmbeddingStore([table], num_shards=2) as store:
        store.apply_gradients("items", ids, grads).result()
        store.checkpoint(str(tmp_path), step=1)
        store.apply_gradients("items", ids, grads).result()
        expected = store.lookup("items", ids, train=False).result()
    with EmbeddingStore.restore(str(tmp_path), [table], num_shards=3) as restored:
        restored.apply_gradients("items", ids, grads).result()
        np.testing.assert_array_equal(restored.lookup("items", ids, train=False).result(), expected)


def test_incremental_checkpoint_writes_only_changed_rows(tmp_path):
    url = str(tmp_path / "ckpt")
    with EmbeddingStore(_tables(), num_shards=2) as store:
        _train(store, 4, seed=0)
        full = store.checkpoint(url, step=1)
        ids = np.arange(100, dtype=np.uint64)
        store.lookup("users", ids)
        store.apply_gradients("users", ids, np.ones((100, 8), np.float32))
        delta = store.checkpoint(url, step=2)
        assert not delta["full"] and delta["rows_written"] == 100
        # Rows are incremental; admission counters (small) are written whole each time.
        assert delta["bytes_written"] < full["bytes_written"] / 5
        empty = store.checkpoint(url, step=3)
        assert empty["rows_written"] == 0
        at_3 = _snapshot(store)
        store.apply_gradients("users", ids[:10], np.ones((10, 8), np.float32))
        store.checkpoint(url, step=4)
        at_4 = _snapshot(store)
    for step, expected in ((3, at_3), (4, at_4)):
        with EmbeddingStore.restore(url, _tables(), step=step, num_shards=3) as restored:
            _assert_same(_snapshot(restored), expected)
    # A delta continues from a restored store too, even with a different shard count.
    with EmbeddingStore.restore(url, _tables(), num_shards=3) as restored:
        restored.apply_gradients("users", ids[:5], np.ones((5, 8), np.float32))
        info = restored.checkpoint(url, step=5)
        assert not info["full"] and info["rows_written"] == 5
        at_5 = _snapshot(restored)
    with EmbeddingStore.restore(url, _tables(), num_shards=1) as restored:
        _assert_same(_snapshot(restored), at_5)


def test_incremental_checkpoint_records_evictions(tmp_path):
    url = str(tmp_path / "ckpt")
    table = TableConfig(name="t", dim=2, capacity=50)
    with EmbeddingStore([table]) as store:
        store.lookup("t", np.arange(50, dtype=np.uint64)).result()
        store.checkpoint(url, step=1)
        store.set_step(5)
        store.lookup("t", np.arange(100, 110, dtype=np.uint64)).result()  # evicts 10 old rows
        info = store.checkpoint(url, step=2)
        assert info["ids_deleted"] == 10 and info["rows_written"] == 10
        rows = store.stats()["rows"]
    with EmbeddingStore.restore(url, [table], num_shards=2) as restored:
        assert restored.stats()["rows"] == rows


def test_table_rows_replay_the_incremental_chain(tmp_path):
    url = str(tmp_path / "ckpt")
    table = TableConfig(name="t", dim=2, capacity=50)
    with EmbeddingStore([table], num_shards=3) as store:
        store.lookup("t", np.arange(50, dtype=np.uint64)).result()
        store.checkpoint(url, step=1)
        rows_at_1 = store.stats()["rows"]
        store.set_step(5)
        store.lookup("t", np.arange(100, 110, dtype=np.uint64)).result()  # evicts old rows
        store.apply_gradients(
            "t", np.arange(100, 105, dtype=np.uint64), np.ones((5, 2), np.float32)
        )
        store.checkpoint(url, step=2)
        ids, values = checkpoint.read_table_rows(url, 2, "t")
        assert len(ids) == store.stats()["rows"]
        assert np.all(np.diff(ids.astype(np.int64)) > 0)  # sorted, unique
        assert set(range(100, 110)) <= set(ids.tolist()) and len(ids) < 60
        np.testing.assert_array_equal(values, store.lookup("t", ids, train=False).result())
    first_ids, _ = checkpoint.read_table_rows(url, 1, "t")
    assert len(first_ids) == rows_at_1 and set(first_ids.tolist()) <= set(range(50))
    with pytest.raises(CheckpointNotFoundError, match="no table 'u'"):
        checkpoint.read_table_rows(url, 2, "u")


class _FailingShard(LocalShard):
    def write_checkpoint(self, url, step, shard_index, **kwargs):
        if step == 2:
            raise OSError("disk full (injected)")
        return super().write_checkpoint(url, step, shard_index, **kwargs)


def test_failed_checkpoint_commits_nothing_and_loses_no_delta(tmp_path):
    url = str(tmp_path / "ckpt")
    tables = _tables()
    shards = [LocalShard(tables, shard_index=0, num_shards=2)]
    shards.append(_FailingShard(tables, shard_index=1, num_shards=2))
    with EmbeddingStore(tables, shards=shards) as store:
        _train(store, 2, seed=0)
        store.checkpoint(url, step=1)
        at_1 = _snapshot(store)
        _train(store, 1, seed=5)
        with pytest.raises(CheckpointError, match="not committed.*disk full"):
            store.checkpoint(url, step=2)
        assert latest_checkpoint_step(url) == 1
        with EmbeddingStore.restore(url, tables, num_shards=2) as restored:
            _assert_same(_snapshot(restored), at_1)
        # The rows changed before the failed attempt are still in the next delta.
        info = store.checkpoint(url, step=3)
        assert not info["full"]
        at_3 = _snapshot(store)
    with EmbeddingStore.restore(url, tables, num_shards=2) as restored:
        _assert_same(_snapshot(restored), at_3)


def test_crash_mid_checkpoint_leaves_previous_loadable(tmp_path):
    """A process killed between part writes (os._exit: no cleanup) leaves step 1 intact."""
    url = str(tmp_path / "ckpt")
    script = textwrap.dedent(
        f"""
        import os, sys
        import numpy as np
        sys.path.insert(0, {str(REPO)!r})
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_checkpoint import _tables, _train, _snapshot
        from hybridrec.embedding_store import EmbeddingStore, checkpoint
        store = EmbeddingStore(_tables(), num_shards=2)
        _train(store, 2, seed=0)
        store.checkpoint({url!r}, step=1)
        np.savez({str(tmp_path / "at_1.npz")!r}, **_snapshot(store))
        _train(store, 1, seed=9)
        write_part = checkpoint.write_part
        written = []
        def crash_after_first_part(*args, **kwargs):
            result = write_part(*args, **kwargs)
            written.append(1)
            if len(written) == 3:
                os._exit(17)
            return result
        checkpoint.write_part = crash_after_first_part
        store.checkpoint({url!r}, step=2)
        """
    )
    child = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 17, child.stderr
    assert (Path(url) / "step-000000000002").exists()  # parts of step 2 were half written
    assert latest_checkpoint_step(url) == 1
    expected = dict(np.load(tmp_path / "at_1.npz"))
    with EmbeddingStore.restore(url, _tables(), num_shards=3) as restored:
        _assert_same(_snapshot(restored), expected)
        # Checkpointing again at step 2 works over the leftovers.
        restored.checkpoint(url, step=2)
    assert latest_checkpoint_step(url) == 2


def _saved(tmp_path, name="ckpt"):
    url = str(tmp_path / name)
    with EmbeddingStore(_tables(), num_shards=2) as store:
        _train(store, 1, seed=0)
        store.checkpoint(url, step=1)
    return url


def test_corrupted_or_partial_checkpoint_is_refused(tmp_path):
    url = _saved(tmp_path)
    part = next((Path(url) / "step-000000000001" / "users").glob("shard-00000*"))
    chunk = next(p for p in (part / "values" / "c").rglob("*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptedError, match="users/shard-00000-of-00002/values"):
        EmbeddingStore.restore(url, _tables())
    url = _saved(tmp_path, "ckpt2")
    for path in (Path(url) / "step-000000000001" / "items").glob("shard-00001*/state/zarr.json"):
        path.unlink()
    with pytest.raises(CheckpointCorruptedError, match="items/shard-00001-of-00002/state"):
        EmbeddingStore.restore(url, _tables())
    (Path(url) / "manifest-000000000001.json").write_text("{not json")
    with pytest.raises(CheckpointCorruptedError, match="unreadable"):
        EmbeddingStore.restore(url, _tables())


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no committed"):
        EmbeddingStore.restore(str(tmp_path / "nothing-here"), _tables())
    url = _saved(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="step 7"):
        EmbeddingStore.restore(url, _tables(), step=7)
    assert latest_checkpoint_step(str(tmp_path / "nothing-here")) is None


def test_incompatible_checkpoint_config(tmp_path):
    url = _saved(tmp_path)
    items, users = _tables()
    with pytest.raises(IncompatibleCheckpointError, match="'users'.*dim 8.*dim 16"):
        EmbeddingStore.restore(url, [items, dataclasses.replace(users, dim=16)])
    sgd = SparseOptimizerConfig(name="sgd")
    with pytest.raises(IncompatibleCheckpointError, match="'items'.*'adam'.*'sgd'"):
        EmbeddingStore.restore(url, [dataclasses.replace(items, optimizer=sgd), users])
    with pytest.raises(IncompatibleCheckpointError, match="tables"):
        EmbeddingStore.restore(url, [items])
    # Hyperparameters may change.
    faster = dataclasses.replace(users.optimizer, learning_rate=0.5)
    EmbeddingStore.restore(url, [items, dataclasses.replace(users, optimizer=faster)]).close()


def test_step_must_advance(tmp_path):
    url = _saved(tmp_path)
    with (
        EmbeddingStore.restore(url, _tables()) as store,
        pytest.raises(CheckpointError, match="not after the latest committed step 1"),
    ):
        store.checkpoint(url, step=1)
    assert os.path.exists(url)
