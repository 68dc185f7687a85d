"""Ids mapped to rows inside the step (model/device_ids.py): the store's initial values from
the same mixed bits, and the hash table against a dict, through collisions and a full table."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hybridrec.embedding_store import initial_rows
from hybridrec.embedding_store._hashing import SALT_INIT, mix64, salt_offset
from hybridrec.embedding_store.config import InitializerConfig
from hybridrec.model import device_ids

RNG = np.random.default_rng(7)


def _halves(ids: np.ndarray) -> tuple[jax.Array, jax.Array]:
    split = device_ids.split_ids(ids)
    return jnp.asarray(split[..., 1]), jnp.asarray(split[..., 0])


def _new_rows(config: InitializerConfig, first_column: int = 0) -> device_ids.NewRows:
    uniform = config.kind == "uniform"
    return device_ids.NewRows(
        config.kind,
        salt_offset(SALT_INIT + config.seed),
        salt_offset(SALT_INIT),
        first_column,
        config.low if uniform else config.mean,
        config.high if uniform else config.stddev,
    )


def test_the_mixing_is_the_stores_bit_for_bit_and_initial_rows_within_a_rounding():
    ids = RNG.integers(0, 2**64, 4000, dtype=np.uint64)
    ids[:4] = [0, 1, 2**32 - 1, 2**64 - 1]  # carries across the halves
    high, low = _halves(ids)
    for salt in (0, 17, SALT_INIT + 12345):
        mixed = jax.jit(device_ids.mix64, static_argnums=1)((high, low), salt_offset(salt))
        np.testing.assert_array_equal(device_ids.joined_ids(*mixed), mix64(ids, salt))

    def rows(config, first_column=0, dim=24):
        new_rows = _new_rows(config, first_column)
        got = jax.jit(device_ids.initial_rows, static_argnums=(0, 3))(new_rows, high, low, dim)
        return np.asarray(got), initial_rows(config, ids, dim, first_column)

    got, want = rows(InitializerConfig(low=-0.05, high=0.05, seed=3), first_column=40)
    # the same bits, the float steps in float32: within two roundings of the value
    np.testing.assert_allclose(got, want, rtol=0, atol=2 * np.spacing(np.float32(0.05)))
    assert np.all(got >= -0.05) and np.all(got <= 0.05)
    got, want = rows(InitializerConfig(kind="normal", mean=0.1, stddev=0.02, seed=5))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-7 * 0.02 / 0.01)
    assert abs(float(np.std(got)) - 0.02) < 1e-3  # and a normal's spread, not a constant
    got, want = rows(InitializerConfig(kind="zeros"))
    assert not got.any() and not want.any()


def _colliding_ids(table_rows: int, count: int) -> np.ndarray:
    """`count` ids crowded into few home slots (long probe runs, contested inserts)."""
    slots = device_ids.capacity(table_rows)
    candidates = RNG.integers(0, 2**64, 400_000, dtype=np.uint64)
    home = np.asarray(jax.jit(device_ids._home, static_argnums=2)(*_halves(candidates), slots))
    crowded = np.flatnonzero(home < 8)  # 8 neighbouring homes: one long cluster
    assert len(crowded) >= count // 2
    return np.concatenate([candidates[crowded[: count // 2]], candidates[: count - count // 2]])


class DictTable:
    """The reference: a dict from id to row; a batch's new ids take rows in ascending order."""

    def __init__(self, rows: int):
        self.rows, self.of = rows, {}

    def map(self, batch: np.ndarray) -> np.ndarray:
        for value in sorted(set(batch.ravel().tolist())):
            if value not in self.of and len(self.of) < self.rows:
                self.of[value] = len(self.of)
        return np.vectorize(lambda v: self.of.get(v, self.rows), otypes=[np.int64])(batch)


def _map(table, batch: np.ndarray, rows: int):
    ids = jnp.asarray(device_ids.split_ids(batch))
    return jax.jit(device_ids.map_ids, static_argnums=2)(table, ids, rows)


def test_ids_map_to_rows_like_a_dict_through_collisions_and_a_restore():
    rows = 300
    pool = _colliding_ids(rows, 280)
    table = {key: jnp.asarray(value) for key, value in device_ids.empty_table(rows).items()}
    reference = DictTable(rows)
    seen = set()
    for step in range(1, 6):
        batch = RNG.choice(pool[: 120 + 40 * step], size=(32, 5))  # repeats within and across
        table, arrays, fresh, distinct = _map(table, batch, rows)
        slots = np.asarray(arrays["slots"])
        inverse = np.asarray(arrays["inverse"])[..., 0]
        np.testing.assert_array_equal(slots[inverse], reference.map(batch))
        np.testing.assert_array_equal(np.asarray(arrays["weights"]), 1.0)
        # the new rows are the batch's ids the table did not hold, each once
        new_ids = device_ids.joined_ids(*np.asarray(distinct))[np.asarray(fresh)]
        assert sorted(new_ids.tolist()) == sorted(set(batch.ravel().tolist()) - seen)
        seen |= set(batch.ravel().tolist())
        assert int(table["used"]) == len(seen) and int(table["clock"]) == step
        # each row knows its id, and the rows the batch trained carry its step
        held = device_ids.joined_ids(table["row_hi"], table["row_lo"])[: len(seen)]
        assert {int(v): r for r, v in enumerate(held)} == reference.of
        trained = np.flatnonzero(np.asarray(table["trained_at"])[:rows] == step)
        np.testing.assert_array_equal(trained, np.unique(slots[inverse]))
    assert not int(table["full"])

    # a restore: the held ids inserted at their rows find the same rows
    restored = {key: jnp.asarray(value) for key, value in device_ids.empty_table(rows).items()}
    restored = jax.jit(device_ids.filled)(
        restored, table["row_hi"][: len(seen)], table["row_lo"][: len(seen)]
    )
    batch = RNG.choice(pool[:200], size=(16, 5))
    _, again, _, _ = _map(restored, batch, rows)
    _, before, _, _ = _map(table, batch, rows)
    for arrays in (again, before):
        at = np.asarray(arrays["slots"])[np.asarray(arrays["inverse"])[..., 0]]
        np.testing.assert_array_equal(at, reference.map(batch))


def test_a_batch_past_the_tables_rows_uses_the_scratch_row_and_says_so():
    rows = 20
    table = {key: jnp.asarray(value) for key, value in device_ids.empty_table(rows).items()}
    batch = np.arange(1, 31, dtype=np.uint64).reshape(10, 3) << np.uint64(40)
    table, arrays, fresh, _ = _map(table, batch, rows)
    at = np.asarray(arrays["slots"])[np.asarray(arrays["inverse"])[..., 0]]
    np.testing.assert_array_equal(at, DictTable(rows).map(batch))  # the first 20 ids by value
    assert (at == rows).sum() == 10 and int(np.asarray(fresh).sum()) == rows
    assert int(table["used"]) == rows and int(table["full"]) == 1


@pytest.mark.parametrize("rows", [1, 1000, 100_000])
def test_the_hash_table_is_at_most_half_full(rows):
    slots = device_ids.capacity(rows)
    assert slots & (slots - 1) == 0 and slots >= 2 * (rows + 1)
