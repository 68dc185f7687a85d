"""A run trained against a remote shard server exports its rows from the checkpoint."""

from __future__ import annotations

import json

import numpy as np
from hybridrec.serving import ServedModel
from hybridrec.serving.reference import evaluate_rows

from hybridrec.cli.server_processes import start_servers, stop_servers

from .tolerance import PARITY

SMALL = [
    "model.dlrm.bottom_mlp=[32, 8]",
    "model.dlrm.top_mlp=[64, 32]",
    "embedding.dim=8",
    "embedding.capacity=200000",
    "data.batch_size=256",
    "data.max_steps=10",
    "checkpoint.every_steps=0",
    "eval.every_steps=0",
]


def test_remote_shard_run_exports_and_serves_like_evaluate(trained, tmp_path, cli):
    servers = start_servers(
        1, num_shards=2, config="quickstart", data=trained.data, overrides=SMALL, log_dir=tmp_path
    )
    run = tmp_path / "run"
    sets = [item for key in SMALL for item in ("--set", key)]
    try:
        cli(
            "train", "--data", str(trained.data), "--run-dir", str(run), "--config", "quickstart",
            "--set", f"embedding.servers={json.dumps([servers[0].address])}", *sets,
        )  # fmt: skip
        # exported while the servers still run: the rows come from the checkpoint
        cli("export", "--run", str(run), "--out", str(tmp_path / "ctr"))
    finally:
        assert stop_servers(servers) == [0]
    saved = json.loads((run / "config.json").read_text())
    assert saved["embedding"]["servers"] == [servers[0].address]
    ids, dense, _, expected = evaluate_rows(run)
    model = ServedModel(tmp_path / "ctr")
    served, _ = model.predict(ids, dense)
    model.close()
    assert model.manifest["step"] == 10
    assert np.max(np.abs(served - expected)) <= PARITY
