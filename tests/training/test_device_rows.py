"""A device table's pooling and sparse update against the host store's, feature by feature:
single- and multi-valued features, every pooling, every sparse optimizer."""

from __future__ import annotations

from concurrent.futures import Future

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hybridrec.embedding_store import (
    EmbeddingStore,
    RaggedIds,
    SparseOptimizerConfig,
    TableConfig,
    unique_inverse,
)
from hybridrec.model import make_mesh
from hybridrec.model.config import MeshConfig
from hybridrec.model.device_tables import (
    DeviceTable,
    DeviceTableLayout,
    SparseRule,
    assemble,
    gather_rows,
    init_tables,
    update_tables,
)
from hybridrec.training.data.input import Batch, DataPosition
from hybridrec.training.device.held_rows import DeviceRows
from hybridrec.training.device.id_bags import distinct_ids
from hybridrec.training.device.plan import DevicePlan

DIM, ROWS = 4, 16


def _batch(rng) -> Batch:
    prefix = np.uint64(1 << 56)  # feature 0's prefix in the high 8 bits, feature 1's below
    single = prefix * np.uint64(1) + rng.integers(1, 9, ROWS).astype(np.uint64)
    counts = rng.integers(0, 4, ROWS)  # some bags empty
    values = prefix * np.uint64(2) + rng.integers(1, 9, int(counts.sum())).astype(np.uint64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    position = DataPosition(**{name: 0 for name in DataPosition.__dataclass_fields__})
    return Batch(
        dense=np.zeros((ROWS, 1), np.float32),
        labels=np.zeros(ROWS, np.float32),
        ids={"single": single, "multi": RaggedIds(values=values, offsets=offsets)},
        valid=np.ones(ROWS, bool),
        position=position,
    )


@pytest.mark.parametrize("pooling", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_a_device_table_pools_and_steps_rows_as_the_store_does(pooling, optimizer):
    rng = np.random.default_rng(0)
    opt = SparseOptimizerConfig(name=optimizer, learning_rate=0.1)
    config = TableConfig(name="t", dim=DIM, capacity=1000, optimizer=opt)
    rule = SparseRule(optimizer, 0.1, opt.eps, opt.beta1, opt.beta2, opt.initial_accumulator)
    layout = DeviceTableLayout((DeviceTable("t", (0, 1), rows=64, dim=DIM, rule=rule),), 2)
    plan = DevicePlan(layout, {"t": ("single", "multi")}, {"t": "t"}, {"t": (1, 2)}, 8)
    mesh = make_mesh(MeshConfig(shape=(1,)), jax.devices()[:1])
    rows = DeviceRows(plan, {"t": config}, mesh, pooling)
    tables = init_tables(layout, mesh)
    features = {"single": "t", "multi": "t"}
    with EmbeddingStore([config]) as store:
        for _ in range(3):  # later batches meet rows the earlier ones created and stepped
            batch = _batch(rng)
            arrays = rows.device_arrays(rows.prepare(batch), slice(None))
            lookup = store.lookup_features(batch.ids, feature_tables=features, pooling=pooling)
            host = lookup.result()
            gathered = gather_rows(layout, tables, arrays)
            values = {"t": gathered["t"][0]}
            empty = jnp.zeros((ROWS, 0, DIM), jnp.float32)
            pooled = assemble(layout, empty, values, arrays)
            np.testing.assert_allclose(np.asarray(pooled), host.embeddings, rtol=1e-6, atol=1e-7)

            upstream = rng.normal(size=(ROWS, 2, DIM)).astype(np.float32)

            def objective(v, arrays=arrays, upstream=upstream):
                return jnp.sum(assemble(layout, jnp.zeros((ROWS, 0, DIM)), v, arrays) * upstream)

            grads = jax.grad(objective)(values)
            tables, _ = update_tables(layout, tables, gathered, grads, arrays)
            store.apply_pooled_gradients(host, upstream).result()
        ids, stored, state = store.read_rows("t")
        slots = rows.rows_of("t", ids)
        assert (slots >= 0).all()
        np.testing.assert_allclose(
            np.asarray(tables["t"]["values"])[slots], stored, rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            np.asarray(tables["t"]["state"])[slots], state, rtol=1e-5, atol=1e-6
        )


def _bags_batch(ids: np.ndarray, counts: np.ndarray) -> Batch:
    """One multi-valued feature: row i's bag is counts[i] of `ids`, in order."""
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    position = DataPosition(**{name: 0 for name in DataPosition.__dataclass_fields__})
    return Batch(
        dense=np.zeros((len(counts), 1), np.float32),
        labels=np.zeros(len(counts), np.float32),
        ids={"multi": RaggedIds(values=ids.astype(np.uint64) + np.uint64(1), offsets=offsets)},
        valid=np.ones(len(counts), bool),
        position=position,
    )


def _multi_valued_rows() -> DeviceRows:
    """DeviceRows of one 8192-row table of the multi-valued feature, SGD, one device."""
    rule = SparseRule("sgd", 0.1, 1e-8, 0.9, 0.999, 0.0)
    layout = DeviceTableLayout((DeviceTable("t", (0,), rows=8192, dim=DIM, rule=rule),), 1)
    plan = DevicePlan(layout, {"t": ("multi",)}, {"t": "t"}, {"t": (1,)}, 8)
    config = TableConfig(name="t", dim=DIM, capacity=8192)
    return DeviceRows(
        plan, {"t": config}, make_mesh(MeshConfig(shape=(1,)), jax.devices()[:1]), "sum"
    )


def test_batch_shapes_keep_the_larger_sizes_seen_before():
    """A batch with fewer distinct rows, fewer new rows or shorter bags keeps the larger
    shapes seen before (no compile)."""
    rows = _multi_valued_rows()

    def shapes_of(prepared):  # every array the step reads, the new rows' values made
        per_example, whole = rows.host_arrays(prepared, slice(None))
        return {key: array.shape for key, array in {**per_example, **whole}.items()}

    wide = rows.prepare(_bags_batch(np.arange(3000), np.full(1000, 3)))  # 3000 new rows
    shapes = shapes_of(wide)
    assert shapes["table/new_rows"] == (4096, DIM)  # 3000 rounded up to a power of two
    assert shapes["table/t/slots"] == (4096,) and shapes["table/t/inverse"] == (1000, 1, 4)
    narrow = rows.prepare(_bags_batch(np.arange(1000) % 100 + 2990, np.ones(1000, int)))
    assert (narrow.arrays["table/t/new"] >= 0).sum() == 90  # ids 3000.. are new
    assert shapes_of(narrow) == shapes


def test_batches_deduplicated_ahead_prepare_as_one_at_a_time():
    """The input thread dedupes batches ahead of the lookup thread's `prepare` (which gives
    new ids rows in step order): every array the step reads, the new rows' initial values
    included, is the same as preparing each batch whole, one after another."""
    rule = SparseRule("adagrad", 0.1, 1e-8, 0.9, 0.999, 0.0)
    layout = DeviceTableLayout((DeviceTable("t", (0, 1), rows=256, dim=DIM, rule=rule),), 2)
    plan = DevicePlan(layout, {"t": ("single", "multi")}, {"t": "t"}, {"t": (1, 2)}, 8)
    config = TableConfig(name="t", dim=DIM, capacity=1000)
    mesh = make_mesh(MeshConfig(shape=(1,)), jax.devices()[:1])
    rng = np.random.default_rng(3)
    batches = [_batch(rng) for _ in range(4)]

    def arrays(prepared_batches, rows):
        out = []
        for prepared in prepared_batches:
            per_example, whole = rows.host_arrays(prepared, slice(None))
            out.append({**per_example, **whole})
        return out

    one_at_a_time = DeviceRows(plan, {"t": config}, mesh, "mean")
    expected = arrays([one_at_a_time.prepare(batch) for batch in batches], one_at_a_time)
    ahead = DeviceRows(plan, {"t": config}, mesh, "mean")
    deduped = [ahead.dedupe(batch) for batch in batches]  # all before the first prepare
    got = arrays([ahead.prepare(b, d) for b, d in zip(batches, deduped, strict=True)], ahead)
    assert [sorted(a) for a in got] == [sorted(a) for a in expected]
    for g, e in zip(got, expected, strict=True):
        for key in e:
            np.testing.assert_array_equal(g[key], e[key], err_msg=key)
            # the strides its shape implies (a stride-0 axis is copied element by element
            # to a GPU)
            assert g[key].strides == np.empty(g[key].shape, g[key].dtype).strides, key
    assert any((e["table/t/new"] >= 0).any() for e in expected[1:])  # later batches bring new ids


def test_a_smaller_new_rows_size_is_compiled_ahead_and_taken_later():
    """Once the tables fill, the new rows' padded size comes down: the size is announced
    to the compile-ahead hook with its shape, taken `delay` batches later, and the first
    batch of it carries the compile for the trainer to wait on."""
    rows = _multi_valued_rows()
    rows.sizes.waste_bytes, rows.sizes.delay = 0, 2
    announced = []

    def hook(shapes):
        announced.append(shapes)
        compiled = Future()
        compiled.set_result(None)
        return compiled

    rows.compile_ahead(hook)
    first = rows.prepare(_bags_batch(np.arange(3000), np.full(1000, 3)))  # 3000 new rows
    assert first.new_rows[0] == (4096, DIM) and first.compiled is None
    later = [
        rows.prepare(_bags_batch(np.arange(n, n + 10), np.ones(10, int)))
        for n in (3000, 3010, 3020)
    ]
    assert announced == [{"table/new_rows": (256, DIM)}]  # 10 new rows: at least 256
    assert [p.new_rows[0][0] for p in later] == [4096, 4096, 256]
    assert [p.compiled is not None for p in later] == [False, False, True]
    assert (later[2].arrays["table/t/new"] >= 0).sum() == 10


def test_distinct_ids_per_feature_are_those_of_one_pass_over_all():
    """Per feature where each feature's ids carry its prefix; one pass over them all where
    they do not (an id two features share is still one distinct id)."""
    rng = np.random.default_rng(5)
    shift = np.uint64(56)
    columns = [
        (np.uint64(p) << shift) | rng.integers(1, 50, 300).astype(np.uint64) for p in (1, 2, 3)
    ]
    whole = unique_inverse(np.concatenate(columns))
    got = distinct_ids(columns, (1, 2, 3), 8)
    np.testing.assert_array_equal(got[0], whole[0])
    np.testing.assert_array_equal(got[1], whole[1])
    shared = [columns[0], columns[0][::-1].copy()]  # the second's ids carry prefix 1, not 2
    unique, inverse = distinct_ids(shared, (1, 2), 8)
    assert len(unique) == len(np.unique(columns[0]))  # not twice
    np.testing.assert_array_equal(unique[inverse], np.concatenate(shared))
