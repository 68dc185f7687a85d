"""The trainer with DMT towers and Shampoo on 8 devices; the Tower Partitioner on its run.

(DHEN is a tower like the others: its step on the 8-device mesh is tested in
tests/model/test_sharded_step.py.)
"""

from __future__ import annotations

import json

from hybridrec.training.partition import propose_towers_from_run


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
