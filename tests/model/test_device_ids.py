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
    """The reference: a dict from id to row. Which of a batch's new ids takes which new row
    is the table's choice; `check` asserts what must hold and learns the choice."""

    def __init__(self, rows: int):
        self.rows, self.of = rows, {}

    def check(self, batch: np.ndarray, at: np.ndarray) -> None:
        """`at`: the table's row of each id of `batch`."""
        seen = dict(self.of)
        for value, row in zip(batch.ravel().tolist(), at.ravel().tolist(), strict=True):
            if value in seen:  # held, or new and met before in this batch: one row
                assert row == seen[value], (value, row, seen[value])
            else:
                seen[value] = row
        new = {v: r for v, r in seen.items() if v not in self.of}
        given = sorted(r for r in new.values() if r < self.rows)
        room = min(len(new), self.rows - len(self.of))
        # the next free rows, each once, as many as there is room for; the rest scratch
        assert given == list(range(len(self.of), len(self.of) + room))
        assert sum(r == self.rows for r in new.values()) == len(new) - room
        self.of.update({v: r for v, r in new.items() if r < self.rows})


def _map(table, batch: np.ndarray, rows: int):
    ids = jnp.asarray(device_ids.split_ids(batch))
    return jax.jit(device_ids.map_ids, static_argnums=2)(table, ids, rows)


def _rows_of(arrays) -> np.ndarray:
    return np.asarray(arrays["slots"])[np.asarray(arrays["inverse"])[..., 0]]


def test_ids_map_to_rows_like_a_dict_through_collisions_and_a_restore():
    rows = 300
    pool = _colliding_ids(rows, 280)
    table = {key: jnp.asarray(value) for key, value in device_ids.empty_table(rows).items()}
    reference = DictTable(rows)
    for step in range(1, 6):
        batch = RNG.choice(pool[: 120 + 40 * step], size=(32, 5))  # repeats within and across
        held = len(reference.of)
        table, arrays, fresh, distinct = _map(table, batch, rows)
        at = _rows_of(arrays)
        reference.check(batch, at)
        np.testing.assert_array_equal(np.asarray(arrays["weights"]), 1.0)
        slots = np.asarray(arrays["slots"])
        assert len(set(slots[slots < rows].tolist())) == len(set(at.ravel().tolist()))
        # the new rows are the batch's ids the table did not hold, each once, with their ids
        new_ids = device_ids.joined_ids(*np.asarray(distinct))[np.asarray(fresh)]
        assert sorted(new_ids.tolist()) == sorted(v for v, r in reference.of.items() if r >= held)
        assert int(table["used"]) == len(reference.of) and int(table["clock"]) == step
        # each row knows its id, and the rows the batch trained carry its step
        ids = device_ids.joined_ids(table["row_hi"], table["row_lo"])[: len(reference.of)]
        assert {int(v): r for r, v in enumerate(ids)} == reference.of
        trained = np.flatnonzero(np.asarray(table["trained_at"])[:rows] == step)
        np.testing.assert_array_equal(trained, np.unique(at))
    assert not int(table["full"])

    # a restore: the held ids inserted at their rows find the same rows
    restored = {key: jnp.asarray(value) for key, value in device_ids.empty_table(rows).items()}
    held = len(reference.of)
    restored = jax.jit(device_ids.filled)(restored, table["row_hi"][:held], table["row_lo"][:held])
    assert int(restored["used"]) == held
    batch = RNG.choice(pool, size=(16, 5))
    unseen = set(batch.ravel().tolist()) - set(reference.of)
    assert unseen and len(unseen) < len(set(batch.ravel().tolist()))
    for hashed in (restored, table):
        _, arrays, fresh, distinct = _map(hashed, batch, rows)
        copy = DictTable(rows)
        copy.of = dict(reference.of)
        copy.check(batch, _rows_of(arrays))
        new_ids = device_ids.joined_ids(*np.asarray(distinct))[np.asarray(fresh)]
        assert set(new_ids.tolist()) == unseen


def test_a_batch_past_the_tables_rows_uses_the_scratch_row_and_says_so():
    rows = 20
    table = {key: jnp.asarray(value) for key, value in device_ids.empty_table(rows).items()}
    batch = np.arange(1, 31, dtype=np.uint64).reshape(10, 3) << np.uint64(40)
    batch = np.concatenate([batch, batch[::-1]])  # each id twice
    table, arrays, fresh, _ = _map(table, batch, rows)
    reference = DictTable(rows)
    reference.check(batch, _rows_of(arrays))
    assert len(reference.of) == rows and int(np.asarray(fresh).sum()) == rows
    assert int(table["used"]) == rows and int(table["full"]) == 1


def test_a_batch_of_more_new_ids_than_slots_ends_and_says_so():
    """Claims of ids past the rows can fill every slot: the probing stops after a sweep."""
    rows = 100
    slots = device_ids.capacity(rows)
    table = {key: jnp.asarray(value) for key, value in device_ids.empty_table(rows).items()}
    batch = RNG.integers(1, 2**64, (slots + 50, 2), dtype=np.uint64)
    table, arrays, fresh, _ = _map(table, batch, rows)
    at = _rows_of(arrays)
    assert int(table["full"]) == 1 and int(table["used"]) == rows
    assert int(np.asarray(fresh).sum()) == rows and np.sum(at < rows) == rows
    held = device_ids.joined_ids(table["row_hi"], table["row_lo"])[:rows]
    np.testing.assert_array_equal(held[at[at < rows]], batch[at < rows])
    # the next batch still finds the ids the table holds
    _, arrays, fresh, _ = _map(table, batch[:40], rows)
    np.testing.assert_array_equal(_rows_of(arrays), at[:40])


def test_the_distinct_rows_are_the_same_by_either_way():
    """By a sort carrying the positions (GPUs) and by a sort and a binary search (CPUs)."""
    for n, top in ((1, 5), (4096, 50), (4096, 100_000)):
        row = jnp.asarray(RNG.integers(0, top + 1, n), jnp.int32)  # top: the scratch row
        by_order = jax.jit(device_ids._distinct_by_order, static_argnums=1)(row, top)
        by_search = jax.jit(device_ids._distinct_by_search, static_argnums=1)(row, top)
        for got in (by_order, by_search):
            distinct, inverse = (np.asarray(a) for a in got)
            unique = np.unique(np.asarray(row))
            np.testing.assert_array_equal(distinct[: len(unique)], unique)
            assert np.all(distinct[len(unique) :] == top)
            np.testing.assert_array_equal(distinct[inverse], np.asarray(row))


@pytest.mark.parametrize("rows", [1, 1000, 100_000])
def test_the_hash_table_is_at_most_half_full(rows):
    slots = device_ids.capacity(rows)
    assert slots & (slots - 1) == 0 and slots >= 2 * (rows + 1)
    empty = device_ids.empty_table(rows)
    assert tuple(empty) == device_ids.KEYS
    assert device_ids.table_bytes(rows) == sum(a.nbytes for a in empty.values())


@pytest.mark.parametrize("processes", [1, 2, 4])
def test_the_hosts_feature_by_feature_blocks_are_put_back_in_example_order(processes):
    """Each process sends its ids as its columns end to end (`feature_major`, no host
    transposition); the global batch the processes' blocks make, put back by the step
    (`batch_major`), is every example's features in order."""
    local, features = 6, 5
    ids = RNG.integers(0, 2**64, (processes * local, features), dtype=np.uint64)
    blocks = [
        device_ids.feature_major(device_ids.split_ids(np.stack(list(part.T))))
        for part in np.split(ids, processes)
    ]
    sent = np.concatenate(blocks)  # make_global_batch: process p's rows at [p*b, (p+1)*b)
    assert sent.shape == (processes * local, features, 2)
    got = jax.jit(device_ids.batch_major, static_argnums=1)(jnp.asarray(sent), processes)
    np.testing.assert_array_equal(np.asarray(got), device_ids.split_ids(ids))
    assert not np.array_equal(sent, device_ids.split_ids(ids))  # not themselves in order
