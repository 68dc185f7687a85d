"""The trainer with DMT towers and Shampoo on 8 devices; the Tower Partitioner on its run.

(DHEN is a tower like the others: its step on the 8-device mesh is tested in
tests/model/test_sharded_step.py.)
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hybridrec.training.learned.partition import propose_towers_from_run


def test_dmt_towers_with_shampoo_train_end_to_end(cli, dataset, tmp_path, training, small_model):
    metadata = json.loads((dataset / "metadata.json").read_text())
    num_features = len(metadata["spec"]["categorical"])
    half = num_features // 2
    towers = [list(range(half)), list(range(half, num_features))]
    run_dir = tmp_path / "run"
    settings = small_model(
        f"model.towers={json.dumps(towers)}",
        "model.tower_mlp=[16]",
        "optimizer.name=shampoo",
        "optimizer.shampoo_block_size=16",
        "optimizer.shampoo_precondition_every=5",
        "eval.max_batches=8",
    )
    cli(*training.args(dataset, run_dir, *settings, "--quiet"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] > 100  # one epoch: many preconditioner refreshes
    assert summary["eval"]["auc"] > 0.55  # it learns: the synthetic labels depend on the ids
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model"]["towers"] == towers and config["optimizer"]["name"] == "shampoo"
    # the Tower Partitioner reads the run's embeddings: a full partition into 3 towers
    proposed, features = propose_towers_from_run(run_dir, dataset, 3, batch_size=256)
    assert len(proposed) == 3 and len(features) == num_features
    assert sorted(index for tower in proposed for index in tower) == list(range(num_features))


def _train_losses(run_dir):
    """(step, loss, samples whose losses the record holds) of each train record: a record
    holds the losses of the steps finished when it was written (the others go to the
    next), so which steps a record's mean covers depends on timing, not their sum."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    train = [r for r in records if r["kind"] == "train"]
    done = np.diff([0, *(r["samples_done"] for r in train)])
    return [(r["step"], r["loss"], int(n)) for r, n in zip(train, done, strict=True)]


def _same_losses(one, other, rtol):
    """The mean loss over every step alike, and each record covering the same samples."""
    means = [sum(loss * n for _, loss, n in run) / sum(n for *_, n in run) for run in (one, other)]
    np.testing.assert_allclose(means[0], means[1], rtol=rtol)
    for (_, a, n), (_, b, m) in zip(one, other, strict=True):
        if n == m:
            np.testing.assert_allclose(a, b, rtol=rtol)


@pytest.mark.devices(8)
def test_dmt_tower_layout_trains_like_flat_and_checkpoints_resumes_evaluates_exports(
    cli, dataset, tmp_path, training, small_model
):
    """`model.layout = "towers"` through `hybridrec train`: each Tower Module on its own
    devices (2 towers x 4 of the 8), the same function and updates as the flat layout."""
    metadata = json.loads((dataset / "metadata.json").read_text())
    num_features = len(metadata["spec"]["categorical"])
    towers = [list(range(0, num_features, 2)), list(range(1, num_features, 2))]
    keys = [
        f"model.towers={json.dumps(towers)}",
        "model.tower_mlp=[16]",
        "hybrid.staleness=0",  # synchronous: both layouts see the same rows
        "data.max_steps=20",
        "checkpoint.every_steps=10",
        "eval.max_batches=4",
    ]
    flat, placed = tmp_path / "flat", tmp_path / "placed"
    cli(*training.args(dataset, flat, *small_model(*keys), "--quiet"))
    cli(*training.args(dataset, placed, *small_model(*keys, 'model.layout="towers"'), "--quiet"))
    flat_losses, placed_losses = _train_losses(flat), _train_losses(placed)
    for run_dir in (flat, placed):  # every lookup saw every update before it
        assert json.loads((run_dir / "summary.json").read_text())["staleness_max"] == 0
    assert [step for step, *_ in placed_losses] == [step for step, *_ in flat_losses]
    _same_losses(placed_losses, flat_losses, rtol=2e-3)
    flat_auc = json.loads((flat / "summary.json").read_text())["eval"]["auc"]
    placed_summary = json.loads((placed / "summary.json").read_text())
    assert abs(placed_summary["eval"]["auc"] - flat_auc) < 2e-3

    # resume to a later step, evaluate the checkpoint, export it and score through it
    cli("train", "--run-dir", str(placed), "--resume", "--quiet", "--set", "data.max_steps=30")
    assert json.loads((placed / "summary.json").read_text())["checkpoint_step"] == 30
    records = [json.loads(line) for line in (placed / "metrics.jsonl").open()]
    rates = {r["step"]: r["learning_rate"] for r in records if r["kind"] == "train"}
    assert rates[20] < 0.01 * rates[5]  # the first run's dense rate decayed to its end, 20
    assert rates[25] > 0.05 * rates[5]  # the resumed run decays to its own end, 30
    evaluated = json.loads(cli("evaluate", "--run", str(placed), "--json").stdout)
    assert evaluated["step"] == 30 and 0.5 < evaluated["auc"] <= 1.0
    cli("export", "--run", str(placed), "--out", str(tmp_path / "export"))
    from hybridrec.serving.model import ServedModel

    served = ServedModel(tmp_path / "export")
    assert served.manifest["step"] == 30
