"""Training against a real shard server, addressed through $HYBRIDREC_EMBEDDING_SERVERS."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
from hybridrec.embedding_store import EmbeddingStore
from hybridrec.embedding_store.remote.client import connect
from hybridrec.pipeline import read_metadata
from hybridrec.training.config import load_config
from hybridrec.training.tables import plan_tables

from hybridrec.cli.server_processes import start_servers, stop_servers


def test_remote_shards_train_checkpoint_and_evaluate_without_rollback(
    dataset, tmp_path, cli, small_model, training
):
    keys = small_model("data.max_steps=20", "checkpoint.every_steps=10")
    settings = keys[1::2]  # the "key=value" items of the --set pairs
    servers = start_servers(
        1, num_shards=2, config="quickstart", data=dataset, overrides=settings, log_dir=tmp_path
    )
    env = {"HYBRIDREC_EMBEDDING_SERVERS": servers[0].address}
    run_dir = tmp_path / "run"
    try:
        cli(*training.args(dataset, run_dir, "--quiet", *keys), env=env)
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 20

        config = load_config("quickstart", [*settings, f"data.path={json.dumps(str(dataset))}"])
        metadata = read_metadata(dataset)
        feature = metadata.categorical[0]
        plan = plan_tables(config.embedding, metadata.categorical)
        tables, table = list(plan.tables), plan.feature_tables[feature.name]
        ids = pq.read_table(metadata.split_files("train")[0], columns=[feature.name])
        ids = np.unique(ids.column(0).to_numpy()[:2000].astype(np.uint64))
        remote = EmbeddingStore(tables, num_shards=2, shards=connect(servers[0].address, tables))

        def server_rows():
            return remote.lookup(table, ids, train=False).result()

        trained = server_rows()
        assert np.abs(trained).sum() > 0
        # the servers wrote the step-20 checkpoint: restored in-process, it equals their rows
        with EmbeddingStore.restore(
            str(run_dir / "checkpoints" / "embeddings"), tables, step=20, num_shards=1
        ) as saved:
            np.testing.assert_array_equal(saved.lookup(table, ids, train=False).result(), trained)
        # evaluating an older checkpoint restores it in-process, never onto the live servers
        result = json.loads(
            cli("evaluate", "--run", str(run_dir), "--step", "10", "--json", env=env).stdout
        )
        assert result["step"] == 10 and np.isfinite(result["logloss"])
        np.testing.assert_array_equal(server_rows(), trained)
    finally:
        assert stop_servers(servers) == [0]


def test_server_killed_mid_training_then_restarted_from_its_checkpoint(
    dataset, tmp_path, cli, small_model, training
):
    total = 60
    keys = small_model(f"data.max_steps={total}", "checkpoint.every_steps=10")
    settings = keys[1::2]
    servers = start_servers(
        1, num_shards=2, config="quickstart", data=dataset, overrides=settings, log_dir=tmp_path
    )
    run_dir = tmp_path / "run"
    env = {
        "HYBRIDREC_EMBEDDING_SERVERS": servers[0].address,
        "HYBRIDREC_EMBEDDING_RETRY_TIMEOUT": "3",
    }
    trainer = training.start(*training.args(dataset, run_dir, "--quiet", *keys), env=env)
    try:
        training.wait_for_checkpoint(trainer, run_dir, 10)
        servers[0].kill()  # SIGKILL: the server's rows since its last checkpoint are gone
        _, stderr = trainer.communicate(timeout=120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    # the trainer gives up after the retry timeout with an error naming the server
    assert trainer.returncode == 2, stderr[-3000:]
    assert "hybridrec train: error:" in stderr and servers[0].address.split(":")[-1] in stderr
    assert "Traceback" not in stderr
    committed = training.last_step(run_dir)
    assert committed is not None and committed < total

    # a new server restored from the last committed checkpoint, and the trainer resumes
    restarted = start_servers(
        1,
        num_shards=2,
        config="quickstart",
        data=dataset,
        overrides=settings,
        restore=str(run_dir / "checkpoints" / "embeddings"),
        log_dir=tmp_path / "restarted",
    )
    try:
        env = {"HYBRIDREC_EMBEDDING_SERVERS": restarted[0].address}
        cli("train", "--run-dir", str(run_dir), "--resume", "--quiet", env=env)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == total and summary["checkpoint_step"] == total
    finally:
        assert stop_servers(restarted) == [0]
