"""The dense step of a sequence run: next-item retrieval by sampled softmax over packed rows.

A batch holds the rows of its distinct items once, `rows [U, D]` (looked up from the
store like any embedding), and everything else as indices into them:

    inputs, targets        [R, L] int32   the item at each position and the one after it
    segments, positions    [R, L] int32   packing (`model.sequence`); segments < 0: padding
    times, event_actions   [R, L] int32   each input event's time and action type (towers
                                          that read them); `actions`: the next event's
    sides                  [R, L, F] int32 each input event's side features' rows (which
                                          share the item table), added to its item's
    weights                [R, L] f32     1 where the position is trained (a next item exists)
    negatives              [N] int32      sampled items, shared by every position
    negative_logq          [N] f32        log(N q(item)), q the sampling probability

The loss at a position is the cross-entropy of its next item against the negatives,
whose logits are corrected by -log(N q) so that the sampled softmax estimates the full
one (Bengio & Senecal; Yi et al. 2019; `sampling_correction`), or gSASRec's generalized
binary cross-entropy of the raw logits (`loss = "gbce"`); a negative equal to the target
is masked. The
gradient with respect to `rows` sums over every position an item appears at, as inputs,
targets and negatives: one sparse update per distinct item.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from hybridrec.model import device_tables
from hybridrec.model import sharding as sharding_lib
from hybridrec.model.config import SequenceConfig
from hybridrec.model.step import ShardedStep, TrainState, apply_dense_gradients
from jax.sharding import Mesh

PER_POSITION = ("inputs", "targets", "segments", "positions", "weights")
SHARED = ("rows", "negatives", "negative_logq")


def scored(vectors: jax.Array, config: SequenceConfig) -> jax.Array:
    """Vectors as the score compares them: L2-normalized for cosine similarity. The norm
    is floored before its square root, so a zero vector (a padded position of a tower
    with no normalization of its own) gets a zero gradient rather than 0/0."""
    vectors = vectors.astype(jnp.float32)
    if config.similarity == "cosine":
        squared = jnp.sum(jnp.square(vectors), axis=-1, keepdims=True)
        return vectors * jax.lax.rsqrt(jnp.maximum(squared, 1e-12))
    return vectors


# the batch's arrays of what a tower reads of each event -> its keywords
CONTEXT_KEYS = {"times": "times", "event_actions": "actions"}


def context_keys(config: SequenceConfig) -> tuple[str, ...]:
    """The batch keys of what the tower reads of each event (`config.context`)."""
    return tuple(key for key, name in CONTEXT_KEYS.items() if name in config.context)


def input_rows(rows: jax.Array, batch: Mapping[str, jax.Array], side_scale: float) -> jax.Array:
    """[R, L, D]: each position's item row, plus its side features' rows (`sides`
    [R, L, F], when the tower reads side features) times `side_scale`."""
    inputs = rows[batch["inputs"]]
    if "sides" in batch:
        inputs = inputs + side_scale * jnp.sum(rows[batch["sides"]], axis=-2)
    return inputs


def call_tower(
    tower, rows: jax.Array, batch: Mapping[str, jax.Array], rng=None, *, side_scale: float
) -> jax.Array:
    """The tower's output at every position, [R, L, D] (with what the batch carries of
    each event: times, action types, for a tower that reads them; its side features'
    rows, times `side_scale`, added to its item's)."""
    context = {name: batch[key] for key, name in CONTEXT_KEYS.items() if key in batch}
    x = input_rows(rows, batch, side_scale)
    return tower(x, batch["segments"], batch["positions"], rng, **context)


def encode(
    graphdef: nnx.GraphDef,
    params: Any,
    rows: jax.Array,
    batch: Mapping[str, jax.Array],
    rng=None,
    *,
    side_scale: float,
) -> jax.Array:
    """The tower's output at every position, [R, L, D]."""
    return call_tower(nnx.merge(graphdef, params), rows, batch, rng, side_scale=side_scale)


def retrieval_loss(
    config: SequenceConfig,
    graphdef: nnx.GraphDef,
    params: Any,
    rows: jax.Array,
    batch: Mapping[str, jax.Array],
    rng=None,
    *,
    hit_mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(mean sampled-softmax cross-entropy over the trained positions, their count).

    `hit_mask` [R, L, N]: the negatives that are the position's target (default: equal
    indices, as in a batch of distinct rows)."""
    outputs = encode(graphdef, params, rows, batch, rng, side_scale=config.side_scale)
    return _retrieval(config, outputs, rows, batch, hit_mask)


def _retrieval(config, outputs, rows, batch, hit_mask=None) -> tuple[jax.Array, jax.Array]:
    outputs = scored(outputs, config)
    targets = scored(rows[batch["targets"]], config)
    negatives = scored(rows[batch["negatives"]], config)
    positive = jnp.sum(outputs * targets, axis=-1) / config.temperature  # [R, L]
    negative = jnp.einsum("rld,nd->rln", outputs, negatives) / config.temperature
    if hit_mask is None:
        hit_mask = batch["negatives"][None, None, :] == batch["targets"][..., None]
    if config.loss == "gbce":  # its beta calibrates for the sampling instead
        losses = _gbce(config, positive, negative, hit_mask, batch["negative_logq"])
    else:
        if config.sampling_correction:
            negative = negative - batch["negative_logq"]
        negative = jnp.where(hit_mask, -1e9, negative)
        logits = jnp.concatenate([positive[..., None], negative], axis=-1)
        losses = jax.nn.logsumexp(logits, axis=-1) - positive
    weights = batch["weights"]
    count = jnp.sum(weights)
    return jnp.sum(losses * weights) / jnp.maximum(count, 1.0), count


def _gbce(config, positive, negative, hit_mask, negative_logq) -> jax.Array:
    """gSASRec's generalized binary cross-entropy at each position (Petrov & Macdonald
    2023): -beta log sigmoid(positive) - sum log(1 - sigmoid(negative)), with beta =
    alpha (t (1 - 1/alpha) + 1/alpha), alpha the negatives' share of the catalogue
    (exp of the mean log(N q): N / C for uniform sampling) and t = `gbce_t`."""
    alpha = jnp.minimum(jnp.exp(jnp.mean(negative_logq)), 1.0)
    beta = alpha * (config.gbce_t * (1.0 - 1.0 / alpha) + 1.0 / alpha)
    negatives = jnp.sum(jnp.where(hit_mask, 0.0, jax.nn.softplus(negative)), axis=-1)
    return beta * jax.nn.softplus(-positive) + negatives


def _ranking(config, model, outputs, rows, batch) -> jax.Array:
    """Mean BCE over the trained positions with an action and every action type: the
    next event's type (one of `config.actions`) against the head's logits."""
    logits = model.rank(outputs, rows[batch["targets"]])  # [R, L, A]
    actions = batch["actions"]
    labels = jax.nn.one_hot(actions - 1, config.actions, dtype=jnp.float32)
    weights = batch["weights"] * (actions > 0)
    losses = optax.sigmoid_binary_cross_entropy(logits, labels).mean(axis=-1)
    return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def sequence_loss(config, graphdef, params, rows, batch, rng=None):
    """The objective's loss (`config.objective`) and its parts."""
    model = nnx.merge(graphdef, params)
    outputs = call_tower(model, rows, batch, rng, side_scale=config.side_scale)
    parts = {}
    if config.retrieval:
        parts["retrieval_loss"], parts["trained_positions"] = _retrieval(
            config, outputs, rows, batch
        )
    if config.ranking:
        parts["ranking_loss"] = _ranking(config, model, outputs, rows, batch)
    loss = parts.get("retrieval_loss", 0.0) + parts.get("ranking_loss", 0.0)
    return loss, parts


def make_sequence_train_step(
    mesh: Mesh,
    config: SequenceConfig,
    seed: int,
    *,
    state_shardings: TrainState | None = None,
    rows_from_chief: bool = False,
    tables: device_tables.DeviceTableLayout | None = None,
) -> ShardedStep:
    """Jits the objective's step once for `mesh`: `state, metrics, row_grads = step(state,
    batch)`.

    `row_grads` [U, D] f32 is d(mean loss)/d(rows), replicated; dropout draws from `seed`
    folded with the step counter, so a resumed run draws what it would have.

    `rows_from_chief`: the batch's `rows` are [data devices, U, D] split over the data
    axis, the rows one process looked up in its first part and zeros elsewhere (trainer
    processes sharing embedding servers: one looks up and updates the rows for all); the
    step sums them, one all-reduce, into the same [U, D] on every device.

    `tables`: the item table on the devices (`model.device_tables`, whole or a hot-row
    cache): the step gathers the batch's rows from it (`slots`, and the new rows' initial
    values; a cache's misses from the batch's `rows`, the host's), and applies the sparse
    optimizer to them after the backward pass. `row_grads` then go to the host store for
    a cache's misses only (with the rows it evicts: `(row_grads, evicted)`), for none
    with a whole table.
    """

    def train_step(state: TrainState, batch: Mapping[str, jax.Array]):
        rng = jax.random.fold_in(jax.random.key(seed), state.step)
        if tables is not None:
            gathered = device_tables.gather_rows(tables, state.tables, batch)
            ((item, (rows, _)),) = gathered.items()
            if tables.caches:  # the host's rows where the cache holds none
                (cache,) = tables.caches
                held = batch[device_tables.array_key(item, "slots")] != cache.scratch
                rows = jnp.where(held[:, None], rows, batch["rows"])
        else:
            rows = jnp.sum(batch["rows"], axis=0) if rows_from_chief else batch["rows"]

        def objective(params, rows):
            return sequence_loss(config, state.graphdef, params, rows, batch, rng)

        (loss, parts), (param_grads, row_grads) = jax.value_and_grad(
            objective, argnums=(0, 1), has_aux=True
        )(state.params, rows)
        new_state, metrics = apply_dense_gradients(state, loss, param_grads)
        if tables is not None:
            updated, evicted = device_tables.update_tables(
                tables, state.tables, gathered, {item: row_grads}, batch
            )
            new_state = new_state.replace(tables=updated)
            if tables.caches:  # the rows it evicts, for the host store
                return new_state, {**metrics, **parts}, (row_grads, evicted)
        return new_state, {**metrics, **parts}, row_grads

    keys = PER_POSITION + (("actions",) if config.ranking else ()) + context_keys(config)
    replicated = sharding_lib.replicated(mesh)
    batch_shardings = {key: sharding_lib.batch_sharding(mesh, 2) for key in keys}
    if config.side_features:
        keys += ("sides",)
        batch_shardings["sides"] = sharding_lib.batch_sharding(mesh, 3)
    batch_shardings |= {key: replicated for key in SHARED}
    if rows_from_chief:
        batch_shardings["rows"] = sharding_lib.batch_sharding(mesh, 3)
    shared = SHARED
    if tables is not None:  # the rows come from the table: its slots and new rows instead
        table_keys = device_tables.sequence_keys(tables)
        if not tables.caches:  # a cache's step takes the host's rows besides
            batch_shardings.pop("rows")
        batch_shardings |= {key: replicated for key in table_keys}
        shared = (*(key for key in SHARED if key in batch_shardings), *table_keys)

    def make_jitted(shardings: TrainState):
        return jax.jit(
            train_step,
            in_shardings=(shardings, batch_shardings),
            out_shardings=(shardings, replicated, replicated),  # (grads, evicted) alike
            donate_argnums=(0,),
        )

    return ShardedStep(train_step, mesh, keys + shared, make_jitted, state_shardings)


def make_sequence_eval_step(
    mesh: Mesh, config: SequenceConfig, *, state_shardings: TrainState | None = None
) -> ShardedStep:
    """Jits `step(state, batch)` -> {"outputs": [R, L, D] the tower's output at every
    position as scores compare it, and with the ranking objective "ranking": [R, L, A]
    the head's logits of each position's next item} (no dropout)."""
    keys = ("rows", "inputs", "segments", "positions") + (("targets",) if config.ranking else ())
    keys += context_keys(config) + (("sides",) if config.side_features else ())

    def eval_step(state: TrainState, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        model = nnx.merge(state.graphdef, state.params)
        rows = batch["rows"]
        outputs = call_tower(model, rows, batch, side_scale=config.side_scale)
        out = {"outputs": scored(outputs, config)}
        if config.ranking:
            out["ranking"] = model.rank(outputs, rows[batch["targets"]])
        return out

    shardings = {key: sharding_lib.batch_sharding(mesh, 2) for key in keys[1:]}
    shardings["rows"] = sharding_lib.replicated(mesh)
    if config.side_features:
        shardings["sides"] = sharding_lib.batch_sharding(mesh, 3)
    outputs = {"outputs": sharding_lib.batch_sharding(mesh, 3)}
    if config.ranking:
        outputs["ranking"] = sharding_lib.batch_sharding(mesh, 3)

    def make_jitted(state_shardings: TrainState):
        return jax.jit(eval_step, in_shardings=(state_shardings, shardings), out_shardings=outputs)

    return ShardedStep(eval_step, mesh, keys, make_jitted, state_shardings)


@jax.jit
def count_above(
    queries: jax.Array, threshold: jax.Array, items: jax.Array, valid: jax.Array, own: jax.Array
):
    """[Q] int32: how many of the `valid` `items` [C, D] score above each query's
    `threshold` [Q] (its target's score), the query's own target (`own` [Q], its index in
    `items`, -1 when absent) left out; queries [Q, D]."""
    scores = jnp.einsum("qd,cd->qc", queries, items, preferred_element_type=jnp.float32)
    other = jnp.arange(items.shape[0])[None, :] != own[:, None]
    return jnp.sum((scores > threshold[:, None]) & valid[None, :] & other, axis=1, dtype=jnp.int32)
