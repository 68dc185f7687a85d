"""Sequence runs, piece by piece against plain references: packing (every trained position
once, no history dropped), the packed batch (back to the histories), the retrieval step's
row gradients (one sparse update per distinct item equals the per-position sum), the
sampled softmax (the full softmax when every item is a negative), and full-ranking
evaluation (against scoring every item in numpy)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hybridrec.common.errors import UserError
from hybridrec.model.config import SequenceConfig
from hybridrec.model.sequence import build_sequence_tower
from hybridrec.model.sequence_step import count_above, retrieval_loss
from hybridrec.training.sequences.batches import (
    Catalogue,
    Histories,
    Negatives,
    SequenceReader,
)
from hybridrec.training.sequences.packing import cut_pieces, pack


def histories_of(rows: list[list[int]], first_target=None) -> Histories:
    lengths = np.array([len(r) for r in rows])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    first = np.ones(len(rows), np.int64) if first_target is None else np.array(first_target)
    items = np.concatenate([np.array(r, np.uint64) for r in rows])
    return Histories(items, offsets, first)


def random_histories(seed=0, users=300, items=50, longest=90) -> Histories:
    rng = np.random.default_rng(seed)
    rows = [list(rng.integers(1, items, size=rng.integers(2, longest))) for _ in range(users)]
    return histories_of(rows)


@pytest.mark.parametrize("split", [True, False])
def test_cut_pieces_cover_every_trained_position_once(split):
    histories = random_histories(longest=70)
    pieces = cut_pieces(histories, 16, split=split)
    assert (pieces.sizes <= 16).all() and (pieces.sizes > 0).all()
    covered = {}
    for h, start, stop in zip(pieces.history, pieces.start, pieces.stop, strict=True):
        for i in range(start, stop):
            assert (h, i) not in covered
            covered[h, i] = True
    positions = histories.lengths - 1
    if split:  # every position of every history, none twice
        assert len(covered) == positions.sum()
    else:  # the most recent 16 of each
        assert len(covered) == np.minimum(positions, 16).sum()
        assert all((h, p - 1) in covered for h, p in enumerate(positions))


def test_pack_places_every_piece_without_overlap_and_pads_little():
    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 40, size=2000)
    batches = pack(sizes, rows=16, length=64)
    seen = np.concatenate([index for index, _, _ in batches])
    assert sorted(seen.tolist()) == list(range(len(sizes)))  # none dropped, none twice
    for index, row, offset in batches:
        for r in range(16):
            spans = sorted(
                (o, o + sizes[i]) for i, rr, o in zip(index, row, offset, strict=True) if rr == r
            )
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
            assert not spans or spans[-1][1] <= 64
    padding = 1 - sizes.sum() / (len(batches) * 16 * 64)
    assert padding < 0.1, padding
    with pytest.raises(ValueError, match="exceeds the row length"):
        pack(np.array([65]), rows=2, length=64)


def test_packed_batches_map_back_to_the_histories_and_resume_exactly():
    histories = random_histories(users=120)
    catalogue = Catalogue.of(histories)
    reader = SequenceReader(
        histories, rows=8, length=32, seed=3, negatives=Negatives(catalogue, 16, "mixed")
    )
    trained = {}
    batches = list(reader.batches(num_batches=reader.batches_per_epoch))
    for batch in batches:
        ids, arrays = batch.ids["item"], batch.arrays
        assert len(np.unique(ids)) == len(ids)  # the store sees each item once
        live = arrays["segments"] >= 0
        assert arrays["weights"][~live].sum() == 0
        for row, col in zip(*np.nonzero(live), strict=True):
            piece = arrays["segments"][row, col]
            h = batch.histories[piece]
            i = batch.starts[piece] + arrays["positions"][row, col]
            history = histories.items[histories.offsets[h] : histories.offsets[h + 1]]
            assert ids[arrays["inputs"][row, col]] == history[i]
            assert ids[arrays["targets"][row, col]] == history[i + 1]
            trained[h, i] = trained.get((h, i), 0) + 1
        assert batch.negatives.max() < len(ids) and len(batch.negative_logq) == 16
    assert len(trained) == (histories.lengths - 1).sum() and set(trained.values()) == {1}
    # a reader started at a saved position yields what the first one did next
    position = reader.position_after(3)
    resumed = list(reader.batches(num_batches=5, position=position))
    for a, b in zip(resumed, batches[3:5], strict=True):
        np.testing.assert_array_equal(a.ids["item"], b.ids["item"])
        np.testing.assert_array_equal(a.arrays["inputs"], b.arrays["inputs"])


def test_a_history_of_ten_thousand_events_trains_in_rows_of_the_row_length():
    """Memory follows the batch's rows and row length, never the longest history."""
    long = list(np.arange(10_000) % 997 + 1)
    histories = histories_of([long, [1, 2, 3], [4, 5]])
    catalogue = Catalogue.of(histories)
    reader = SequenceReader(
        histories, rows=4, length=200, negatives=Negatives(catalogue, 8, "batch")
    )
    trained = 0
    for batch in reader.batches(num_batches=reader.batches_per_epoch):
        assert batch.arrays["inputs"].shape == (4, 200)
        trained += int(batch.arrays["weights"].sum())
    assert trained == 9_999 + 2 + 1  # every position of every history, once
    truncated = SequenceReader(histories, rows=4, length=200, split_long=False)
    assert truncated.batches_per_epoch == 1


def test_more_negatives_than_items_is_one_line():
    catalogue = Catalogue.of(histories_of([[1, 2, 3], [2, 3, 4]]))
    with pytest.raises(UserError, match="negatives = 10 is more than the 4 items"):
        Negatives(catalogue, 10, "catalogue")


@pytest.fixture(scope="module", params=["sasrec", "hstu"])
def tower(request):
    config = SequenceConfig(max_length=16, blocks=2, heads=2, dropout=0.0, attention="reference")
    module = build_sequence_tower(request.param, config, dim=8, dtype=None, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(module, nnx.Param)
    return config, graphdef, nnx.to_pure_dict(params)


def _batch(rng, rows=3, length=16, distinct=12, negatives=5):
    segments = np.repeat(np.arange(4), 4)[None].repeat(rows, 0).astype(np.int32)
    segments[:, -3:] = -1
    positions = np.tile(np.arange(4), 4)[None].repeat(rows, 0).astype(np.int32)
    return {
        "inputs": rng.integers(0, distinct, (rows, length)).astype(np.int32),
        "targets": rng.integers(0, distinct, (rows, length)).astype(np.int32),
        "segments": segments,
        "positions": positions,
        "weights": (segments >= 0).astype(np.float32),
        "negatives": rng.integers(0, distinct, negatives).astype(np.int32),
        "negative_logq": rng.normal(size=negatives).astype(np.float32),
    }


def test_row_gradients_sum_every_position_of_an_item(tower):
    """The step differentiates the distinct rows; a plain reference differentiates one
    row per occurrence (inputs, targets, negatives) and sums by item."""
    config, graphdef, params = tower
    rng = np.random.default_rng(0)
    batch = _batch(rng)
    rows = jnp.asarray(rng.normal(size=(12, 8)).astype(np.float32))
    grads = jax.grad(lambda r: retrieval_loss(config, graphdef, params, r, batch)[0])(rows)

    def per_occurrence(inputs, targets, negatives):
        expanded = jnp.concatenate([inputs.reshape(-1, 8), targets.reshape(-1, 8), negatives])
        count = inputs.shape[0] * inputs.shape[1]
        index = np.arange(2 * count + len(batch["negatives"]))
        plain = {
            **batch,
            "inputs": index[:count].reshape(batch["inputs"].shape).astype(np.int32),
            "targets": index[count : 2 * count].reshape(batch["targets"].shape).astype(np.int32),
            "negatives": index[2 * count :].astype(np.int32),
        }
        # a negative equal to the target is masked by id, not by position
        hit = batch["negatives"][None, None, :] == batch["targets"][..., None]
        plain["negative_logq"] = batch["negative_logq"]
        loss = retrieval_loss(config, graphdef, params, expanded, plain, hit_mask=hit)[0]
        return loss

    occurrence = [rows[batch["inputs"]], rows[batch["targets"]], rows[batch["negatives"]]]
    parts = jax.grad(per_occurrence, argnums=(0, 1, 2))(*occurrence)
    reference = np.zeros((12, 8), np.float32)
    np.add.at(reference, batch["inputs"].reshape(-1), np.asarray(parts[0]).reshape(-1, 8))
    np.add.at(reference, batch["targets"].reshape(-1), np.asarray(parts[1]).reshape(-1, 8))
    np.add.at(reference, batch["negatives"], np.asarray(parts[2]))
    np.testing.assert_allclose(np.asarray(grads), reference, rtol=1e-4, atol=1e-6)


def test_sampled_softmax_with_every_item_as_negative_is_the_full_softmax(tower):
    config, graphdef, params = tower
    rng = np.random.default_rng(1)
    batch = _batch(rng, negatives=12)
    batch["negatives"] = np.arange(12, dtype=np.int32)
    batch["negative_logq"] = np.zeros(12, np.float32)  # log(N q) with q = 1 / N
    rows = jnp.asarray(rng.normal(size=(12, 8)).astype(np.float32))
    loss, count = retrieval_loss(config, graphdef, params, rows, batch)
    tower = nnx.merge(graphdef, params)
    out = tower(rows[batch["inputs"]], batch["segments"], batch["positions"])
    logits = jnp.einsum("rld,nd->rln", out, rows)
    full = (
        jax.nn.logsumexp(logits, -1)
        - jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    )
    expected = (full * batch["weights"]).sum() / batch["weights"].sum()
    assert int(count) == int(batch["weights"].sum())
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5)


@pytest.mark.parametrize("gbce_t", [0.0, 0.75])
def test_gbce_and_the_uncorrected_softmax_against_numpy(tower, gbce_t):
    """`loss = "gbce"`: beta log sigmoid of the positive (beta = 1 at t = 0: plain binary
    cross-entropy) and log(1 - sigmoid) of each negative but the target, raw logits;
    `sampling_correction = false`: the cross-entropy without -log(N q)."""
    import dataclasses

    config, graphdef, params = tower
    rng = np.random.default_rng(4)
    batch = _batch(rng, negatives=6)
    batch["negative_logq"] = np.full(6, np.log(6 / 12), np.float32)  # alpha = 6 / 12
    rows = jnp.asarray(rng.normal(size=(12, 8)).astype(np.float32))
    out = np.asarray(nnx.merge(graphdef, params)(rows[batch["inputs"]], batch["segments"], batch["positions"]))  # fmt: skip
    logits = np.einsum("rld,nd->rln", out, np.asarray(rows))
    positive = np.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    negative = logits[..., batch["negatives"]]
    hit = batch["negatives"][None, None, :] == batch["targets"][..., None]
    weights = batch["weights"]

    def softplus(x):
        return np.logaddexp(0.0, x)

    alpha = 0.5
    beta = alpha * (gbce_t * (1 - 1 / alpha) + 1 / alpha)
    gbce = beta * softplus(-positive) + np.where(hit, 0.0, softplus(negative)).sum(-1)
    gbce_config = dataclasses.replace(config, loss="gbce", gbce_t=gbce_t)
    loss = retrieval_loss(gbce_config, graphdef, params, rows, batch)[0]
    np.testing.assert_allclose(float(loss), (gbce * weights).sum() / weights.sum(), rtol=1e-5)
    plain = dataclasses.replace(config, sampling_correction=False)
    masked = np.where(hit, -1e9, negative)
    both = np.concatenate([positive[..., None], masked], -1)
    cross_entropy = np.log(np.exp(both - both.max(-1, keepdims=True)).sum(-1)) + both.max(-1) - positive  # fmt: skip
    loss = retrieval_loss(plain, graphdef, params, rows, batch)[0]
    np.testing.assert_allclose(float(loss), (cross_entropy * weights).sum() / weights.sum(), rtol=1e-5)  # fmt: skip


def test_outputs_do_not_see_other_segments_or_the_future(tower):
    config, graphdef, params = tower
    rng = np.random.default_rng(2)
    module = nnx.merge(graphdef, params)
    x = jnp.asarray(rng.normal(size=(1, 16, 8)).astype(np.float32))
    segments = jnp.asarray(np.repeat(np.arange(4), 4)[None].astype(np.int32))
    positions = jnp.asarray(np.tile(np.arange(4), 4)[None].astype(np.int32))
    out = module(x, segments, positions)
    changed = x.at[0, 9].set(5.0)  # segment 2, its second position
    moved = module(changed, segments, positions)
    same = np.isclose(np.asarray(out), np.asarray(moved), atol=1e-5).all(-1)[0]
    assert same[:9].all() and not same[9:12].all() and same[12:].all()


def test_cosine_scores_of_a_zero_vector_have_a_finite_gradient():
    """A tower's padded position can be exactly zero (no normalization of its own):
    cosine scoring must not turn it into 0/0 in the backward pass."""
    from hybridrec.model.sequence_step import scored

    config = SequenceConfig(max_length=8, similarity="cosine")
    vectors = np.zeros((3, 4), np.float32)
    vectors[1] = [3.0, 4.0, 0.0, 0.0]
    out = scored(jnp.asarray(vectors), config)
    np.testing.assert_allclose(np.asarray(out)[1], [0.6, 0.8, 0.0, 0.0], rtol=1e-6)
    gradient = jax.grad(lambda v: jnp.sum(scored(v, config) * 2.0))(jnp.asarray(vectors))
    assert np.isfinite(np.asarray(gradient)).all()


def test_count_above_matches_numpy():
    rng = np.random.default_rng(3)
    queries = rng.normal(size=(7, 4)).astype(np.float32)
    items = rng.normal(size=(30, 4)).astype(np.float32)
    threshold = rng.normal(size=7).astype(np.float32)
    valid = rng.random(30) > 0.3
    own = rng.integers(-1, 30, size=7).astype(np.int32)  # each query's target, -1: absent
    above = (queries @ items.T > threshold[:, None]) & valid
    above[np.arange(7)[own >= 0], own[own >= 0]] = False
    counted = count_above(queries, threshold, items, valid, own)
    np.testing.assert_array_equal(np.asarray(counted), above.sum(1))


def test_the_ranking_loss_is_the_mean_bce_over_positions_with_an_action():
    from hybridrec.model.sequence import build_sequence_tower
    from hybridrec.model.sequence_step import sequence_loss

    config = SequenceConfig(
        max_length=16, blocks=1, dropout=0.0, objective="ranking", actions=3, ranking_hidden=8
    )
    module = build_sequence_tower("sasrec", config, dim=8, dtype=None, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(module, nnx.Param)
    rng = np.random.default_rng(4)
    batch = _batch(rng)
    batch["actions"] = rng.integers(0, 4, size=batch["inputs"].shape).astype(np.int32)
    rows = jnp.asarray(rng.normal(size=(12, 8)).astype(np.float32))
    loss, parts = sequence_loss(config, graphdef, params, rows, batch)
    model = nnx.merge(graphdef, params)
    outputs = model(rows[batch["inputs"]], batch["segments"], batch["positions"])
    logits = np.asarray(model.rank(outputs, rows[batch["targets"]]), np.float64)
    labels = np.eye(3)[np.maximum(batch["actions"] - 1, 0)]
    bce = np.maximum(logits, 0) - logits * labels + np.log1p(np.exp(-np.abs(logits)))
    weights = batch["weights"] * (batch["actions"] > 0)
    expected = (bce.mean(-1) * weights).sum() / weights.sum()
    assert set(parts) == {"ranking_loss"}
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    # "both": the two losses summed
    both = dataclasses.replace(config, objective="both")
    batch["negatives"], batch["negative_logq"] = batch["negatives"][:3], batch["negative_logq"][:3]
    total, parts = sequence_loss(both, graphdef, params, rows, batch)
    assert set(parts) == {"ranking_loss", "retrieval_loss", "trained_positions"}
    np.testing.assert_allclose(
        float(total), float(parts["ranking_loss"] + parts["retrieval_loss"]), rtol=1e-6
    )
    np.testing.assert_allclose(float(parts["ranking_loss"]), expected, rtol=1e-5)
