"""Ids mapped to rows inside the jitted step: a hash table per device table, on the devices.

Where the host maps a device table's ids (`training.device.held_rows`), each batch's ids are
deduplicated, looked up in a host hash map and turned into index arrays before the step.
On an accelerator whose dense step takes a millisecond, that host work is most of a step.
A table with `DeviceTable.new_rows` set gets the batch's raw ids instead: `ids`
[B, F_t, 2] uint32, each 64-bit id as its (low, high) halves. The step then maps them
itself, before the forward pass, and makes the arrays the host would have made (`slots`,
`new`, `inverse`, `weights`, the new rows' values), so the rest of the step
(`model.device_tables`) is unchanged:

1. **Find or insert.** Open addressing with linear probing over `keys_hi`, `keys_lo` and
   `slot_rows` [C]. C is a power of two at least twice the table's rows, so the table is
   at most half full. Every occurrence of the global batch probes at once, in rounds:
   one at its key takes the key's row; one at an empty slot claims it (the lowest index
   wins a contested slot), and a winner takes the next free row. Every device and
   process runs the same program over the same global batch, so every replica of the
   table agrees. The other occurrences of a new id find its claim the round after.
2. **Distinct rows.** The occurrences' rows are sorted (int32) and each occurrence gets
   its row's index among the distinct ones.
3. **Initial values.** The store's initializer (`embedding_store._initializers`), computed
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
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hybridrec.common import splitmix

U32 = jnp.uint32
WINDOW = 8  # slots a probe looks at per round: a few rounds, where one slot a round took
# as many rounds as the longest probe (21 at a third full, 426k ids a batch)
COUNTERS = ("clock", "used", "full")  # int32 scalars
# a device table's hash-table arrays: per slot, per row (the scratch row too), counters
KEYS = ("keys_hi", "keys_lo", "slot_rows", "row_hi", "row_lo", "trained_at", *COUNTERS)
ROW_BYTES = 4 * 12 + 12  # a row's share of its table's hash arrays on every device, at most:
# 12 bytes a slot (key halves, row) and under 4 slots a row, and its id and stamp


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


def table_bytes(rows: int) -> int:
    """Bytes of the hash-table arrays of a device table of `rows` rows, on every device:
    three 4-byte arrays per slot, three per row and the counters."""
    return 12 * capacity(rows) + 12 * (rows + 1) + 4 * len(COUNTERS)


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


def find_or_insert(
    table: Mapping[str, jax.Array],
    high: jax.Array,
    low: jax.Array,
    capacity_rows: int,
    given: jax.Array | None = None,
) -> tuple[dict[str, jax.Array], jax.Array]:
    """(the table, each id's row [n]): the ids it holds find their rows; each id it does
    not hold is inserted once, however often it occurs, and takes the next free row (or
    `given`'s). An id past `capacity_rows` gets the scratch row and sets `full`.

    In rounds, every occurrence at once, each looking at `WINDOW` slots from where it
    stands. During them `slot_rows` holds a row (a key held before the batch), -1 (empty)
    or, below -1, a claim: the index of the occurrence that won the slot this batch. The
    first slot of the window that ends the probe decides: a held key that is the
    occurrence's id gives its row; a claim whose winner has its id gives the winner's
    row; an empty slot is claimed (a scatter-min: the lowest index wins; a loser looks at
    the winner next round). A window without one moves the probe on. Winners take the
    next free rows in index order. A winner past the rows gives its slot back and takes
    the scratch row; from then on an id that reaches an empty slot is past the rows too
    and takes the scratch row without a claim (held ids are still found: a key comes
    before the first empty slot from its home), so claims never fill the slots. The keys
    are written once, after the rounds, so the rounds only read them (a key array
    written and read in one round is copied whole each round: XLA's CPU and GPU
    compilers both copy it)."""
    slots, n = table["slot_rows"].shape[0], high.shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    claim = index - (n + 1)  # below -1, the empty mark; the lowest index the lowest
    scratch = capacity_rows
    keys_hi, keys_lo = table["keys_hi"], table["keys_lo"]
    window = jnp.arange(WINDOW, dtype=jnp.int32)

    def pending(carry):
        return jnp.any(carry[-1])

    def first(values, k):
        return jnp.take_along_axis(values, k[:, None], axis=1)[:, 0]

    def round_(carry):
        full, slot_rows, used, at, row, won_at, waiting = carry
        seen = (at[:, None] + window) & (slots - 1)  # [n, WINDOW] slots from `at` on
        held = slot_rows[seen]
        mine = (keys_hi[seen] == high[:, None]) & (keys_lo[seen] == low[:, None])
        winner = jnp.clip(held + (n + 1), 0, n - 1)  # of a claimed slot
        same = (held < -1) & (high[winner] == high[:, None]) & (low[winner] == low[:, None])
        stop = ((held >= 0) & mine) | same | (held == -1)
        k = jnp.argmax(stop, axis=1)  # the first slot that ends the probe, if any
        ends = waiting & jnp.any(stop, axis=1)
        at_k, held_k = first(seen, k), first(held, k)
        found = ends & (held_k >= 0)
        same_k = ends & (held_k < -1)
        late = ends & (held_k == -1) & (full > 0)  # a new id once the rows ran out
        empty = ends & (held_k == -1) & (full == 0)
        slot_rows = slot_rows.at[jnp.where(empty, at_k, slots)].min(claim, mode="drop")
        won = empty & (slot_rows[at_k] == claim)
        given_row = used + jnp.cumsum(won, dtype=jnp.int32) - 1 if given is None else given
        fits = won & (given_row < capacity_rows)
        over = won & ~fits  # its slot given back
        slot_rows = slot_rows.at[jnp.where(over, at_k, slots)].set(-1, mode="drop")
        row = jnp.where(found, held_k, jnp.where(fits, given_row, row))
        row = jnp.where(same_k, row[first(winner, k)], jnp.where(over | late, scratch, row))
        won_at = jnp.where(fits, at_k, won_at)
        # on: past a window without an end; a lost claim looks at its winner next round
        at = jnp.where(waiting & ~ends, (at + WINDOW) & (slots - 1), at)
        at = jnp.where(empty & ~won, at_k, at)
        used = used + jnp.sum(fits, dtype=jnp.int32)
        full = full | jnp.any(over).astype(jnp.int32)
        waiting = waiting & ~(found | won | same_k | late)
        return full, slot_rows, used, at, row, won_at, waiting

    start = (
        table["full"],
        table["slot_rows"],
        table["used"],
        _home(high, low, slots),
        jnp.full(n, scratch, jnp.int32),
        jnp.full(n, slots, jnp.int32),
        jnp.ones(n, bool),
    )
    full, slot_rows, used, _, row, won_at, _ = jax.lax.while_loop(pending, round_, start)
    # the claims become rows, the keys and the rows' ids are written
    slot_rows = slot_rows.at[won_at].set(row, mode="drop")
    row_at = jnp.where(won_at < slots, row, table["row_hi"].shape[0])
    return {
        **table,
        "slot_rows": slot_rows,
        "keys_hi": keys_hi.at[won_at].set(high, mode="drop"),
        "keys_lo": keys_lo.at[won_at].set(low, mode="drop"),
        "row_hi": table["row_hi"].at[row_at].set(high, mode="drop"),
        "row_lo": table["row_lo"].at[row_at].set(low, mode="drop"),
        "used": used,
        "full": full,
    }, row


def distinct_rows(row: jax.Array, scratch: int) -> tuple[jax.Array, jax.Array]:
    """(the distinct rows of `row` [n], ascending, padded with the scratch row; each
    occurrence's index among them [n]).

    On a GPU one sort of the rows carrying their positions (CUB's radix sort of pairs),
    the indices scattered back. On a CPU, where XLA's sort carrying a second array is
    several times slower than of one (200 against 30 ms for 426k rows), a sort of the
    rows alone and a binary search per occurrence."""
    return jax.lax.platform_dependent(
        row,
        cpu=functools.partial(_distinct_by_search, scratch=scratch),
        default=functools.partial(_distinct_by_order, scratch=scratch),
    )


def _distinct_by_order(row: jax.Array, scratch: int) -> tuple[jax.Array, jax.Array]:
    n = row.shape[0]
    ordered, order = jax.lax.sort((row, jnp.arange(n, dtype=jnp.int32)), num_keys=1)
    first = jnp.concatenate([jnp.ones(1, bool), ordered[1:] != ordered[:-1]])
    group = jnp.cumsum(first, dtype=jnp.int32) - 1
    distinct = jnp.full(n, scratch, jnp.int32)
    distinct = distinct.at[jnp.where(first, group, n)].set(ordered, mode="drop")
    return distinct, jnp.zeros(n, jnp.int32).at[order].set(group)


def _distinct_by_search(row: jax.Array, scratch: int) -> tuple[jax.Array, jax.Array]:
    n = row.shape[0]
    ordered = jnp.sort(row)
    first = jnp.concatenate([jnp.ones(1, bool), ordered[1:] != ordered[:-1]])
    target = jnp.where(first, jnp.cumsum(first, dtype=jnp.int32) - 1, n)
    top = jnp.iinfo(jnp.int32).max  # after every row: the padding keeps them sorted
    distinct = jnp.full(n, top, jnp.int32).at[target].set(ordered, mode="drop")
    inverse = jnp.searchsorted(distinct, row).astype(jnp.int32)
    return jnp.where(distinct == top, scratch, distinct), inverse


def map_ids(
    table: Mapping[str, jax.Array], ids: jax.Array, capacity_rows: int
) -> tuple[dict[str, jax.Array], dict[str, jax.Array], jax.Array, jax.Array]:
    """One batch's ids [B, F, 2] (low, high halves) mapped to rows of a table of
    `capacity_rows` rows (its scratch row the next).

    Returns (the hash table after the batch: new ids inserted, the rows it trains stamped
    with the clock; {"slots" [n]: the batch's distinct rows, padded with the scratch row,
    "inverse" [B, F, 1], "weights" [B, F, 1]}; which of the n distinct rows are new;
    the distinct rows' ids as halves [2, n], for their initial values), with n = B * F.
    """
    batch, features = ids.shape[:2]
    before = table["used"]
    table, row = find_or_insert(
        table, ids[..., 1].reshape(-1), ids[..., 0].reshape(-1), capacity_rows
    )
    slots, inverse = distinct_rows(row, capacity_rows)
    fresh = (slots >= before) & (slots < capacity_rows)  # rows given in this batch
    clock = table["clock"] + 1
    table = {**table, "trained_at": table["trained_at"].at[slots].set(clock), "clock": clock}
    arrays = {
        "slots": slots,
        "inverse": inverse.reshape(batch, features, 1),
        "weights": jnp.ones((batch, features, 1), jnp.float32),
    }
    return table, arrays, fresh, jnp.stack([table["row_hi"][slots], table["row_lo"][slots]])


def batch_major(ids: jax.Array, processes: int) -> jax.Array:
    """A batch's `ids` array as the host sends it -> [B, F, 2], example b's feature f at
    [b, f].

    The host sends each process's ids feature by feature: process p's block of the B / P
    rows holds its [F, B / P, 2] ids laid end to end (its columns as the reader holds
    them, so the host transposes nothing); the step puts them back in example order."""
    batch, features = ids.shape[:2]
    local = batch // processes
    by_feature = ids.reshape(processes, features, local, 2)
    return by_feature.transpose(0, 2, 1, 3).reshape(batch, features, 2)


def feature_major(ids: np.ndarray) -> np.ndarray:
    """[F, b, 2] ids of one process (host numpy) -> the [b, F, 2] block it sends
    (`batch_major` undoes it in the step): a view when `ids` is contiguous."""
    features, local = ids.shape[:2]
    return np.ascontiguousarray(ids).reshape(local, features, 2)


def filled(table: Mapping[str, jax.Array], high: jax.Array, low: jax.Array) -> dict:
    """The table holding the distinct ids `high`, `low` [n] at rows [0, n) (a restore:
    `training.device.mapped_ids`), none of them trained since."""
    rows = jnp.arange(high.shape[0], dtype=jnp.int32)
    table, _ = find_or_insert(table, high, low, table["row_hi"].shape[0] - 1, given=rows)
    return table


def split_ids(ids: np.ndarray) -> np.ndarray:
    """[...] uint64 ids -> [..., 2] uint32 (low, high): the batch's `ids` array."""
    ids = np.ascontiguousarray(ids, np.uint64)
    if ids.dtype.byteorder == ">" or (ids.dtype.byteorder == "=" and np.little_endian is False):
        return np.stack([(ids & 0xFFFFFFFF).astype(np.uint32), (ids >> 32).astype(np.uint32)], -1)
    return ids.view(np.uint32).reshape(*ids.shape, 2)


def joined_ids(high: Any, low: Any) -> np.ndarray:
    """uint32 halves -> uint64 ids (host numpy)."""
    return (np.asarray(high, np.uint64) << np.uint64(32)) | np.asarray(low, np.uint64)
