"""Users' towers, defined here: a pooled one trains through `hybridrec train`, exports and
serves the probabilities evaluation computes; a sequence one trains through the Python API
with the class itself; a tower that breaks the contract is one line at start-up."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hybridrec.common.errors import UserError
from hybridrec.model.hstu_attention import live_pairs
from hybridrec.model.layers import linear


class TinyPooled(nnx.Module):
    """The pooled contract: embeddings [B, F, D] and dense [B, n] to logits [B]."""

    def __init__(self, *, num_dense, num_features, embedding_dim, dtype, rngs, hidden=16):
        width = num_dense + num_features * embedding_dim
        self.hidden = linear(width, hidden, (None, "mlp"), dtype=dtype, rngs=rngs)
        self.out = linear(hidden, 1, ("mlp", None), dtype=dtype, rngs=rngs)

    def __call__(self, embeddings, dense):
        flat = jnp.concatenate([dense, embeddings.reshape(embeddings.shape[0], -1)], axis=-1)
        return self.out(jax.nn.relu(self.hidden(flat)))[:, 0]


class TinySequence(nnx.Module):
    """The sequence contract: each position the mean of its history so far, mixed."""

    kind = "sequence"

    def __init__(self, *, dim, max_length, dtype, rngs, scale=1.0):
        self.mix = linear(dim, dim, (None, None), dtype=dtype, rngs=rngs)
        self.scale = scale

    def __call__(self, x, segments, positions, rng=None):
        live = live_pairs(segments).astype(x.dtype)  # [R, L, L]: same history, not ahead
        mean = live @ x / jnp.maximum(live.sum(-1, keepdims=True), 1.0)
        return self.mix(mean) * self.scale


class WrongShape(TinyPooled):
    def __call__(self, embeddings, dense):
        return super().__call__(embeddings, dense)[:, None]


class NeedsMore(TinyPooled):
    def __init__(self, *, num_dense, num_features, embedding_dim, dtype, rngs, depth):
        super().__init__(
            num_dense=num_dense,
            num_features=num_features,
            embedding_dim=embedding_dim,
            dtype=dtype,
            rngs=rngs,
        )


def path(name: str) -> str:
    return f"{__name__}:{name}"


def test_a_pooled_tower_of_ones_own_trains_exports_and_serves(dataset, tmp_path, cli, small_model):
    from hybridrec.serving import ServedModel
    from hybridrec.serving.reference import evaluate_rows

    run, out = tmp_path / "run", tmp_path / "export"
    keys = small_model("data.max_steps=15", f"model.tower={json.dumps(path('TinyPooled'))}")
    keys += ["--set", "model.tower_config.hidden=8"]
    cli("train", "--data", str(dataset), "--run-dir", str(run), "--config", "quickstart", *keys)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 15 and summary["eval"]["auc"] > 0.5
    cli("export", "--run", str(run), "--out", str(out), "--precision", "fp32")
    ids, dense, _, probabilities = evaluate_rows(run, dataset)
    model = ServedModel(out, max_batch=64)
    try:
        served, _ = model.predict(ids[:256], dense[:256])
    finally:
        model.close()
    np.testing.assert_allclose(served, probabilities[:256], atol=1e-5)


def test_a_sequence_tower_passed_as_a_class_trains(tmp_path):
    import hybridrec
    from tests.training.test_sequence_training import SMALL, events_dataset

    data = events_dataset(tmp_path / "events")
    config = hybridrec.load_config("sasrec", [*SMALL, "data.max_steps=10"])
    summary = hybridrec.train(
        config, data=data, run_dir=tmp_path / "run", tower=TinySequence, quiet=True
    )
    assert summary["steps"] == 10 and summary["eval"]["hr@10"] > 0
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["tower"] == path("TinySequence")
    assert hybridrec.evaluate(tmp_path / "run", split="test")["queries"] > 0
    # it exports and serves like the built-in towers (without extend: no cached histories)
    from hybridrec.serving import ServedSequenceModel

    exported = hybridrec.export(tmp_path / "run", tmp_path / "export", quiet=True)["path"]
    model = ServedSequenceModel(exported, max_batch=8)
    history = model.catalogue[:5]
    items, scores = model.top_k(model.encode([history])[0], 3, [history])
    assert items.shape == (1, 3) and not np.isin(items, history).any()
    _, _, _, caches, computed = model.encode_kept([history], [None])
    assert caches == [None] and computed[0] == 5  # recomputed, not cached


@pytest.mark.parametrize(
    "tower, extra, words",
    [
        ("no_such_module_here:Tower", [], "module 'no_such_module_here' does not import"),
        (path("Missing"), [], "has no class 'Missing'"),
        (path("WrongShape"), [], r"returns shape \[4, 1\] for logits \[B\] \[4\]"),
        (path("NeedsMore"), [], "__init__ needs depth"),
        (path("TinyPooled"), ["model.tower_config.width=3"], "width not taken by"),
        (path("TinySequence"), [], "reads user histories, but"),
    ],
)
def test_a_tower_that_breaks_the_contract_is_one_line(dataset, tower, extra, words):
    from hybridrec.training.config import load_config
    from hybridrec.training.tasks import prepare

    config = load_config(
        "quickstart",
        [f"data.path={json.dumps(str(dataset))}", f"model.tower={json.dumps(tower)}", *extra],
    )
    with pytest.raises(UserError, match=words) as raised:
        prepare(config)
    assert "\n" not in str(raised.value)
