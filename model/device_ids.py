"""Ids mapped to rows inside the jitted step: a hash table per device table, on the devices.

Where the host maps a device table's ids (`training.device_rows`), each batch's ids are
deduplicated, looked up in a host hash map and turned into index arrays before the step.
On an accelerator whose dense step takes a millisecond, that host work is most of a step.
A table with `DeviceTable.new_rows` set gets the batch's raw ids instead: `ids`
[B, F_t, 2] uint32, each 64-bit id as its (low, high) halves. The step then maps them
itself, before the forward pass, and makes the arrays the host would have made (`slots`,
`new`, `inverse`, `weights`, the new rows' values), so the rest of the step
(`model.device_tables`) is unchanged:

1. **Distinct ids.** The global batch's ids are sorted, with both halves as keys. Each
   occurrence gets its index among the distinct ids.
2. **Find.** Open addressing with linear probing over `keys_hi`, `keys_lo` and
   `slot_rows` [C]. C is a power of two at least twice the table's rows, so the table is
   at most half full. Probing goes on while some id has found neither its key nor an
   empty slot.
3. **New ids.** Ids not found take the next free rows, in sorted order. Every device and
   process runs the same program over the same global batch, so every replica of the
   table agrees. They are inserted in rounds: each pending id claims the empty slot it
   stands at (a scatter-min: the lowest index wins a contested slot) and the others move
   on past it.
4. **Initial values.** The store's initializer (`embedding_store._initializers`), computed
   in uint32 halves (splitmix64's 64-bit products from 16-bit limbs): the same mixed bits
   as the store's. The float steps run in float32, where the store's run in float64 and
   round once, so a value can differ from the store's in its last bit or two.

The table also keeps each row's id (`row_hi`, `row_lo`) and the step that last trained
the row (`trained_at`, against the `clock` each step advances). The host then finds the
rows to write back to the store without tracking batches. `used` counts the rows given
out. `full` is set once a batch brings more new ids than rows are left; those ids read
and train the scratch row, and the host raises at its next write-back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hybridrec.common import splitmix

U32 = jnp.uint32
HASH_KEYS = ("keys_hi", "keys_lo", "slot_rows", "row_hi", "row_lo", "trained_at")
COUNTERS = ("clock", "used", "full")  # int32 scalars


@dataclasses.dataclass(frozen=True)
class NewRows:
    """How a device table's new rows get their values: the store's initializer, as numbers.

    Args:
        kind: "uniform", "normal" or "zeros".
        row_salt: added to an id before mixing it into the row's key
            (`embedding_store._hashing.salt_offset` of the initializer's salt and seed).
        column_salt: added to each column's counter before mixing.
        first_column: the table's first column (columns mix their global index).
        a: uniform: the low bound; normal: the mean.
        b: uniform: the high bound; normal: the standard deviation.
    """

    kind: str
    row_salt: int
    column_salt: int
    first_column: int = 0
    a: float = 0.0
    b: float = 0.0


def capacity(rows: int) -> int:
    """Slots of the hash table of a device table of `rows` rows: a power of two at least
    twice the rows (the scratch row included)."""
    return 1 << max(10, (2 * (rows + 1) - 1).bit_length())


def empty_table(rows: int) -> dict[str, np.ndarray]:
    """The hash-table arrays of a device table of `rows` rows, holding no id."""
    slots, held = capacity(rows), rows + 1
    return {
        "keys_hi": np.zeros(slots, np.uint32),
        "keys_lo": np.zeros(slots, np.uint32),
        "slot_rows": np.full(slots, -1, np.int32),
        "row_hi": np.zeros(held, np.uint32),
        "row_lo": np.zeros(held, np.uint32),
        "trained_at": np.zeros(held, np.int32),
        "clock": np.zeros((), np.int32),
        "used": np.zeros((), np.int32),
        "full": np.zeros((), np.int32),
    }


# ---- 64-bit integers as (high, low) uint32 pairs ----------------------------------------


def _constant(value: int) -> tuple[jax.Array, jax.Array]:
    value &= splitmix.MASK64
    return U32(value >> 32), U32(value & 0xFFFFFFFF)


def _mulhi(a: jax.Array, b: jax.Array) -> jax.Array:
    """The high 32 bits of the 64-bit product of uint32 `a` and `b` (16-bit limbs)."""
    a0, a1 = a & U32(0xFFFF), a >> 16
    b0, b1 = b & U32(0xFFFF), b >> 16
    low, cross1, cross2 = a0 * b0, a0 * b1, a1 * b0
    carry = ((low >> 16) + (cross1 & U32(0xFFFF)) + (cross2 & U32(0xFFFF))) >> 16
    return a1 * b1 + (cross1 >> 16) + (cross2 >> 16) + carry


def _mul(a, b):
    """(high, low) * (high, low) mod 2^64."""
    (ah, al), (bh, bl) = a, b
    return _mulhi(al, bl) + al * bh + ah * bl, al * bl


def _add(a, b):
    low = a[1] + b[1]
    return a[0] + b[0] + (low < a[1]).astype(U32), low


def _xor_shifted(a, shift: int):
    """a ^ (a >> shift), 0 < shift < 32."""
    high, low = a
    return high ^ (high >> shift), low ^ ((low >> shift) | (high << (32 - shift)))


def mix64(value, offset: int):
    """splitmix64 of `value + offset` (`embedding_store._hashing.mix64` with the offset of
    its salt), on (high, low) uint32 pairs."""
    z = _add(value, _constant(offset))
    z = _mul(_xor_shifted(z, 30), _constant(splitmix.MUL1))
    z = _mul(_xor_shifted(z, 27), _constant(splitmix.MUL2))
    return _xor_shifted(z, 31)


def initial_rows(new_rows: NewRows, high: jax.Array, low: jax.Array, dim: int) -> jax.Array:
    """[n] ids as uint32 halves -> [n, dim] float32: the store's initial values of their
    columns [first_column, first_column + dim) (`embedding_store.initial_rows`)."""
    if new_rows.kind == "zeros":
        return jnp.zeros((high.shape[0], dim), jnp.float32)
    key = mix64((high, low), new_rows.row_salt)
    columns = jnp.arange(new_rows.first_column, new_rows.first_column + dim, dtype=U32)
    step = _mul((jnp.zeros_like(columns), columns), _constant(splitmix.COLUMN_STEP))
    counter = _add((key[0][:, None], key[1][:, None]), (step[0][None, :], step[1][None, :]))
    bits_high, bits_low = mix64(counter, new_rows.column_salt)
    if new_rows.kind == "uniform":  # the top 53 bits as a fraction, as far as float32 goes
        unit = (
            bits_high.astype(jnp.float32) * 2.0**-32
            + (bits_low >> 11).astype(jnp.float32) * 2.0**-53
        )
        return new_rows.a + (new_rows.b - new_rows.a) * unit
    # normal: Box-Muller on the two halves, u1 in (0, 1] so that its log is finite
    u1 = (bits_low.astype(jnp.float32) + 1.0) * 2.0**-32
    u2 = bits_high.astype(jnp.float32) * 2.0**-32
    radius = jnp.sqrt(-2.0 * jnp.log(u1))
    return new_rows.a + new_rows.b * radius * jnp.cos(2.0 * np.pi * u2)


# ---- the hash table ----------------------------------------------------------------------


def _fmix32(h: jax.Array) -> jax.Array:
    h = (h ^ (h >> 16)) * U32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * U32(0xC2B2AE35)
    return h ^ (h >> 16)


def _home(high: jax.Array, low: jax.Array, slots: int) -> jax.Array:
    """Each id's first slot to probe."""
    return (_fmix32(low ^ _fmix32(high ^ U32(0x9E3779B9))) & U32(slots - 1)).astype(jnp.int32)


def find(
    table: Mapping[str, jax.Array], high: jax.Array, low: jax.Array, active: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(the row of each `active` id, -1 where the table does not hold it; the slot each
    probe stopped at: the id's own, or for one not held the empty slot it would take)."""
    slot_rows = table["slot_rows"]
    slots = slot_rows.shape[0]

    def probing(carry):
        return ~jnp.all(carry[2])

    def probe(carry):
        at, row, done = carry
        held = slot_rows[at]
        hit = (held >= 0) & (table["keys_hi"][at] == high) & (table["keys_lo"][at] == low)
        row = jnp.where(hit & ~done, held, row)
        stop = done | hit | (held < 0)
        return jnp.where(stop, at, (at + 1) & (slots - 1)), row, stop

    start = (_home(high, low, slots), jnp.full(high.shape, -1, jnp.int32), ~active)
    at, row, _ = jax.lax.while_loop(probing, probe, start)
    return row, at


def insert(
    table: Mapping[str, jax.Array],
    high: jax.Array,
    low: jax.Array,
    rows: jax.Array,
    at: jax.Array,
    pending: jax.Array,
) -> dict[str, jax.Array]:
    """The table with the `pending` ids (distinct, none of them held) mapped to `rows`,
    each starting from the slot `find` stopped at. In rounds: an id at a free slot claims
    it (the lowest index wins), an id at a taken one moves on."""
    slots = table["slot_rows"].shape[0]
    index = jnp.arange(high.shape[0], dtype=jnp.int32)

    def inserting(carry):
        return jnp.any(carry[4])

    def round_(carry):
        keys_hi, keys_lo, slot_rows, at, pending = carry
        free = slot_rows[at] < 0
        claims = jnp.full(slots, high.shape[0], jnp.int32)
        claims = claims.at[jnp.where(pending & free, at, slots)].min(index, mode="drop")
        won = pending & free & (claims[at] == index)
        target = jnp.where(won, at, slots)
        keys_hi = keys_hi.at[target].set(high, mode="drop")
        keys_lo = keys_lo.at[target].set(low, mode="drop")
        slot_rows = slot_rows.at[target].set(rows, mode="drop")
        moving = pending & ~free
        at = jnp.where(moving, (at + 1) & (slots - 1), at)
        return keys_hi, keys_lo, slot_rows, at, pending & ~won

    start = (table["keys_hi"], table["keys_lo"], table["slot_rows"], at, pending)
    keys_hi, keys_lo, slot_rows, _, _ = jax.lax.while_loop(inserting, round_, start)
    return {**table, "keys_hi": keys_hi, "keys_lo": keys_lo, "slot_rows": slot_rows}


def distinct(high: jax.Array, low: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(distinct ids' high and low halves [n], ascending, the rest zeros; which of the n
    are distinct ids; each id's index among them [n])."""
    n = high.shape[0]
    sorted_high, sorted_low, order = jax.lax.sort(
        (high, low, jnp.arange(n, dtype=jnp.int32)), num_keys=2
    )
    first = jnp.concatenate(
        [
            jnp.ones(1, bool),
            (sorted_high[1:] != sorted_high[:-1]) | (sorted_low[1:] != sorted_low[:-1]),
        ]
    )
    group = jnp.cumsum(first, dtype=jnp.int32) - 1
    inverse = jnp.zeros(n, jnp.int32).at[order].set(group)
    target = jnp.where(first, group, n)
    unique_high = jnp.zeros(n, U32).at[target].set(sorted_high, mode="drop")
    unique_low = jnp.zeros(n, U32).at[target].set(sorted_low, mode="drop")
    return unique_high, unique_low, jnp.arange(n) <= group[-1], inverse


def map_ids(
    table: Mapping[str, jax.Array], ids: jax.Array, capacity_rows: int
) -> tuple[dict[str, jax.Array], dict[str, jax.Array], jax.Array, jax.Array]:
    """One batch's ids [B, F, 2] (low, high halves) mapped to rows of a table of
    `capacity_rows` rows (its scratch row the next).

    Returns (the hash table after the batch: new ids inserted, the rows it trains stamped
    with the clock; {"slots" [n]: the batch's distinct rows, padded with the scratch row,
    "inverse" [B, F, 1], "weights" [B, F, 1]}; which of the n distinct rows are new;
    the distinct ids' halves [2, n], for their initial values), with n = B * F.
    """
    batch, features = ids.shape[:2]
    high, low, valid, inverse = distinct(ids[..., 1].reshape(-1), ids[..., 0].reshape(-1))
    row, at = find(table, high, low, valid)
    fresh = valid & (row < 0)
    used = table["used"]
    given = used + jnp.cumsum(fresh, dtype=jnp.int32) - 1
    fits = fresh & (given < capacity_rows)
    table = insert(table, high, low, given, at, fits)
    scratch = capacity_rows
    row = jnp.where(fresh, jnp.where(fits, given, scratch), row)
    row = jnp.where(valid, row, scratch)
    placed = jnp.where(fits, given, capacity_rows + 1)  # out of range: dropped
    clock = table["clock"] + 1
    count = jnp.sum(fresh, dtype=jnp.int32)
    table = {
        **table,
        "row_hi": table["row_hi"].at[placed].set(high, mode="drop"),
        "row_lo": table["row_lo"].at[placed].set(low, mode="drop"),
        "trained_at": table["trained_at"].at[row].set(clock),
        "clock": clock,
        "used": jnp.minimum(used + count, capacity_rows),
        "full": table["full"] | (used + count > capacity_rows).astype(jnp.int32),
    }
    arrays = {
        "slots": row,
        "inverse": inverse.reshape(batch, features, 1),
        "weights": jnp.ones((batch, features, 1), jnp.float32),
    }
    return table, arrays, fits, jnp.stack([high, low])


def filled(table: Mapping[str, jax.Array], high: jax.Array, low: jax.Array) -> dict:
    """The table holding the distinct ids `high`, `low` [n] at rows [0, n) (a restore:
    `training.device_ids`), none of them trained since."""
    n = high.shape[0]
    everyone = jnp.ones(n, bool)
    _, at = find(table, high, low, everyone)
    rows = jnp.arange(n, dtype=jnp.int32)
    table = insert(table, high, low, rows, at, everyone)
    return {
        **table,
        "row_hi": table["row_hi"].at[rows].set(high),
        "row_lo": table["row_lo"].at[rows].set(low),
        "used": jnp.asarray(n, jnp.int32),
    }


def split_ids(ids: np.ndarray) -> np.ndarray:
    """[...] uint64 ids -> [..., 2] uint32 (low, high): the batch's `ids` array."""
    ids = np.ascontiguousarray(ids, np.uint64)
    if ids.dtype.byteorder == ">" or (ids.dtype.byteorder == "=" and np.little_endian is False):
        return np.stack([(ids & 0xFFFFFFFF).astype(np.uint32), (ids >> 32).astype(np.uint32)], -1)
    return ids.view(np.uint32).reshape(*ids.shape, 2)


def joined_ids(high: Any, low: Any) -> np.ndarray:
    """uint32 halves -> uint64 ids (host numpy)."""
    return (np.asarray(high, np.uint64) << np.uint64(32)) | np.asarray(low, np.uint64)
