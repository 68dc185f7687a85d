"""Quantized checkpoints: error bounds, sizes, restore-and-continue, mixed chains, corruption."""

from pathlib import Path

import numpy as np
import pytest
from hybridrec.embedding_store import (
    AdmissionConfig,
    CheckpointCorruptedError,
    CheckpointError,
    EmbeddingStore,
    SparseOptimizerConfig,
    TableConfig,
    checkpoint,
)
from hybridrec.embedding_store._quantize import dequantize, quantize
from hybridrec.embedding_store.remote.client import connect
from hybridrec.embedding_store.remote.shard_server import ShardServer

IDS = np.arange(3000, dtype=np.uint64)


def _tables(dim=8):
    return [
        TableConfig(
            name="items",
            dim=dim,
            capacity=100_000,
            optimizer=SparseOptimizerConfig(name="adam", learning_rate=0.01),
            admission=AdmissionConfig(min_count=2),
        ),
        TableConfig(name="users", dim=dim, capacity=100_000),  # adagrad
    ]


def _train(store, steps, seed, dim=8):
    rng = np.random.default_rng(seed)
    for step in range(steps):
        store.set_step(step)
        for table in ("items", "users"):
            ids = rng.integers(0, len(IDS), size=512).astype(np.uint64)
            store.lookup(table, ids)
            store.apply_gradients(table, ids, rng.normal(size=(512, dim)).astype(np.float32))
    store.flush()


def _snapshot(store):
    return {t: store.lookup(t, IDS, train=False).result() for t in ("items", "users")}


def _row_ranges(rows):
    return rows.max(axis=1) - rows.min(axis=1)


@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("width", [1, 7, 16])
def test_row_quantization_stays_within_half_a_step(precision, width):
    rng = np.random.default_rng(width)
    rows = rng.normal(size=(500, width)) * rng.uniform(1e-4, 5, size=(500, 1))
    rows = (rows + rng.normal(size=(500, 1))).astype(np.float32)
    rows[0] = 0.1  # a constant row
    encoded = quantize(rows, precision)
    decoded = dequantize(encoded, precision, width)
    assert decoded.shape == rows.shape and decoded.dtype == np.float32
    error = np.abs(decoded - rows).max(axis=1)
    if precision == "fp16":
        assert (error <= np.abs(rows).max(axis=1) * 2.0**-11).all()
        return
    levels = {"int8": 255, "int4": 15}[precision]
    scale = encoded["scale_bias"].astype(np.float32)[:, 0]
    assert encoded["scale_bias"].dtype == np.float16
    rounding = np.abs(rows).max(axis=1) * 2.0**-21  # float32 arithmetic of decoding
    assert (error <= scale / 2 * (1 + 1e-5) + rounding).all()
    # The float16 scale is at most a hair coarser than the row's own range needs.
    needed = _row_ranges(rows) / levels
    assert (scale <= needed * (1 + 2.0**-9) + np.abs(rows.min(axis=1)) * 2.0**-9 + 1e-7).all()
    assert error[0] < 1e-6


def test_rows_past_float16_range_keep_a_float32_scale():
    rows = np.array([[0, 1e6], [-3e5, 2e5]], np.float32)
    encoded = quantize(rows, "int8")
    assert encoded["scale_bias"].dtype == np.float32
    assert np.abs(dequantize(encoded, "int8", 2) - rows).max() <= 1e6 / 255 / 2 * 1.001
    assert quantize(rows, "fp16")[""].dtype == np.float32


@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_quantized_checkpoint_restores_onto_other_shard_counts_and_continues(tmp_path, precision):
    url = str(tmp_path / "ckpt")
    with EmbeddingStore(_tables(), num_shards=4) as store:
        _train(store, 3, seed=0)
        info = store.checkpoint(url, step=3, precision=precision)
        assert info["precision"] == precision and info["rows_written"] == store.stats()["rows"]
        saved, stats = _snapshot(store), store.stats()
        _train(store, 2, seed=1)
        reference = _snapshot(store)
    tolerance = {"fp16": 1e-3, "int8": 0.02, "int4": 0.3}[precision]
    for num_shards in (3, 1):
        with EmbeddingStore.restore(url, _tables(), num_shards=num_shards) as restored:
            restored_stats = restored.stats()
            # Ids, admission counters and last steps are exact; only values are rounded.
            assert restored_stats["rows"] == stats["rows"]
            assert restored_stats["pending_admission"] == stats["pending_admission"]
            for table, rows in _snapshot(restored).items():
                held = np.abs(saved[table]).max(axis=1) > 0
                np.testing.assert_array_equal(np.abs(rows).max(axis=1) > 0, held)
                bound = (
                    _row_ranges(saved[table]) / {"fp16": 1e3, "int8": 255, "int4": 15}[precision]
                )
                assert (np.abs(rows - saved[table]).max(axis=1) <= bound + 1e-6).all(), table
            _train(restored, 2, seed=1)
            for table, rows in _snapshot(restored).items():
                # The optimizer state came back too: training continues where it was.
                np.testing.assert_allclose(rows, reference[table], atol=tolerance, err_msg=table)


def test_quantized_checkpoints_are_smaller_and_incremental_ones_smaller_still(tmp_path):
    tables = [
        TableConfig(
            name="items", dim=16, capacity=100_000, optimizer=SparseOptimizerConfig(name="adam")
        ),
        TableConfig(name="users", dim=16, capacity=100_000),  # adagrad
    ]
    sizes = {}
    for precision in ("fp32", "fp16", "int8", "int4"):
        with EmbeddingStore(tables, num_shards=2) as store:
            _train(store, 2, seed=0, dim=16)
            sizes[precision] = store.checkpoint(str(tmp_path / precision), 1, precision=precision)
            if precision == "int8":
                store.apply_gradients("users", IDS[:100], np.ones((100, 16), np.float32))
                delta = store.checkpoint(str(tmp_path / precision), 2, precision=precision)

    def ratios(table):
        written = {
            p: sum(
                e["bytes"]
                for e in checkpoint.read_manifest(str(tmp_path / p), 1)["tables"][table]["chain"][
                    0
                ]["parts"]
            )
            for p in sizes
        }
        return {p: written[p] / written["fp32"] for p in written}

    # Bytes per Adagrad row at dim 16: 8 (id) + 4 (last step) + 64 + 64 at fp32, and
    # 8 + 4 + 2 * (16 + 4) at int8, 8 + 4 + 2 * (8 + 4) at int4.
    adagrad = ratios("users")
    assert adagrad == pytest.approx(
        {"fp32": 1, "fp16": 76 / 140, "int8": 52 / 140, "int4": 36 / 140}
    )
    # Adam: 8 + 4 + 64 + 128 + 4 (step count) at fp32; moments are bfloat16 below fp32.
    adam = ratios("items")
    assert adam == pytest.approx(
        {"fp32": 1, "fp16": 112 / 208, "int8": 100 / 208, "int4": 92 / 208}
    )
    assert delta["rows_written"] == 100
    assert delta["bytes_written"] == 100 * (8 + 4 + 2 * (16 + 4))  # only the changed rows
    on_disk = {
        p: sum(
            f.stat().st_size
            for f in (tmp_path / p / "step-000000000001" / "users").rglob("*")
            if f.is_file()
        )
        for p in sizes
    }
    assert on_disk["int4"] < on_disk["int8"] < 0.4 * on_disk["fp32"], on_disk  # Adagrad table


def test_a_chain_mixing_precisions_restores_each_part_at_its_own(tmp_path):
    url = str(tmp_path / "ckpt")
    ids = np.arange(100, dtype=np.uint64)
    with EmbeddingStore(_tables(), num_shards=2) as store:
        _train(store, 3, seed=0)
        store.checkpoint(url, step=1)  # full, fp32
        store.apply_gradients("users", ids, np.ones((100, 8), np.float32))
        delta = store.checkpoint(url, step=2, precision="int4")
        assert not delta["full"] and delta["rows_written"] == 100
        expected = _snapshot(store)
    manifest = checkpoint.read_manifest(url)
    chain = manifest["tables"]["users"]["chain"]
    assert [group["parts"][0]["precision"] for group in chain] == ["fp32", "int4"]
    with EmbeddingStore.restore(url, _tables(), num_shards=3) as restored:
        rows = _snapshot(restored)
        np.testing.assert_array_equal(rows["items"], expected["items"])  # only in the fp32 part
        untouched = np.setdiff1d(IDS, ids).astype(np.int64)
        np.testing.assert_array_equal(rows["users"][untouched], expected["users"][untouched])
        changed = rows["users"][:100] - expected["users"][:100]
        assert (
            0
            < np.abs(changed).max()
            <= _row_ranges(expected["users"][:100]).max() / 30 * 1.01 + 1e-6
        )
        # The restored store extends the int4 checkpoint with an int8 delta.
        restored.apply_gradients("users", ids[:5], np.ones((5, 8), np.float32))
        assert restored.checkpoint(url, step=3, precision="int8")["rows_written"] == 5
    ids_read, _ = checkpoint.read_table_rows(url, 3, "users")
    with EmbeddingStore.restore(url, _tables()) as restored:
        assert restored.stats()["tables"]["users"]["rows"] == len(ids_read)


def test_corrupt_quantized_arrays_are_named(tmp_path):
    def saved(name):
        url = str(tmp_path / name)
        with EmbeddingStore(_tables(), num_shards=2) as store:
            _train(store, 1, seed=0)
            store.checkpoint(url, step=1, precision="int8")
        return url, Path(url) / "step-000000000001" / "users" / "shard-00001-of-00002"

    for array in ("values", "values_scale_bias", "state_accumulator"):
        url, part = saved(array)
        chunk = next(p for p in (part / array / "c").rglob("*") if p.is_file())
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0x5A
        chunk.write_bytes(bytes(data))
        with pytest.raises(
            CheckpointCorruptedError, match=f"shard-00001-of-00002/{array}: checksum"
        ):
            EmbeddingStore.restore(url, _tables())
    url, part = saved("missing")
    (part / "state_accumulator_scale_bias" / "zarr.json").unlink()
    with pytest.raises(CheckpointCorruptedError, match="state_accumulator_scale_bias: missing"):
        EmbeddingStore.restore(url, _tables())


def test_unknown_precision_is_refused_before_anything_is_written(tmp_path):
    with EmbeddingStore(_tables(), num_shards=2) as store:
        _train(store, 1, seed=0)
        with pytest.raises(CheckpointError, match="'int3' is not one of fp32, fp16, int8, int4"):
            store.checkpoint(str(tmp_path / "ckpt"), step=1, precision="int3")
    assert not (tmp_path / "ckpt").exists()


def test_remote_shards_write_quantized_parts(tmp_path):
    tables = _tables()
    servers = [ShardServer(tables, [index], num_shards=2) for index in (0, 1)]
    try:
        shards = connect([f"127.0.0.1:{server.port}" for server in servers], tables)
        with EmbeddingStore(tables, num_shards=2, shards=shards) as store:
            _train(store, 2, seed=0)
            info = store.checkpoint(str(tmp_path / "ckpt"), step=2, precision="int4")
            expected = _snapshot(store)
    finally:
        for server in servers:
            server.drain_and_stop(timeout=5)
    assert info["precision"] == "int4"
    with EmbeddingStore.restore(str(tmp_path / "ckpt"), tables, num_shards=1) as restored:
        for table, rows in _snapshot(restored).items():
            bound = _row_ranges(expected[table]) / 30 * 1.01 + 1e-6
            assert (np.abs(rows - expected[table]).max(axis=1) <= bound).all(), table


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_every_optimizer_state_layout_round_trips_at_int8(tmp_path, optimizer):
    table = TableConfig(
        name="items",
        dim=5,  # odd: int4 codes are padded to whole bytes
        capacity=10_000,
        optimizer=SparseOptimizerConfig(name=optimizer, learning_rate=0.1),
    )
    ids = np.arange(300, dtype=np.uint64)
    grads = np.random.default_rng(0).normal(size=(300, 5)).astype(np.float32)
    for precision in ("int8", "int4"):
        url = str(tmp_path / precision)
        with EmbeddingStore([table], num_shards=2) as store:
            store.apply_gradients("items", ids, grads).result()
            store.checkpoint(url, step=1, precision=precision)
            store.apply_gradients("items", ids, grads).result()
            expected = store.lookup("items", ids, train=False).result()
        with EmbeddingStore.restore(url, [table], num_shards=3) as restored:
            restored.apply_gradients("items", ids, grads).result()
            got = restored.lookup("items", ids, train=False).result()
        # Every optimizer continues from its restored state, close to the unrestored run.
        tolerance = {"int8": 0.01, "int4": 0.15}[precision]
        np.testing.assert_allclose(got, expected, atol=tolerance, err_msg=precision)
