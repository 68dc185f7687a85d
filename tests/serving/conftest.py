"""A tiny trained run, its export, a running `hybridrec serve`, and evaluate's per-row answers."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
ROWS = 12_000
TOKEN = "serving-test-token"

# the quickstart preset, shrunk so the run trains in seconds
SMALL_RUN = [
    "model.dlrm.bottom_mlp=[32, 8]",
    "model.dlrm.top_mlp=[64, 32]",
    "embedding.dim=8",
    "embedding.capacity=200000",
    "data.batch_size=256",
    "data.shuffle_buffer=4096",
    "log.every_steps=10",
    "checkpoint.every_steps=0",
    "eval.every_steps=0",
]


def hybridrec(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs the real command line; fails the test with its output on a non-zero exit."""
    result = subprocess.run(
        [sys.executable, "-m", "hybridrec", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        pytest.fail(
            f"hybridrec {' '.join(args)} exited {result.returncode}\n"
            f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
        )
    return result


class Server:
    """A `hybridrec serve` subprocess on a free loopback port."""

    def __init__(self, *args: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hybridrec", "serve", *args, "--port", "0"],
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.process.stdout.readline()
        if "http://" not in line:
            self.process.kill()
            pytest.fail(
                f"hybridrec serve did not start: {line}{self.process.stderr.read()[-3000:]}"
            )
        self.url = line.split("http://", 1)[1].split()[0]
        self.url = "http://" + self.url

    def stop(self) -> str:
        """Stops the server (SIGTERM, as a process manager would); returns its stderr."""
        self.process.terminate()
        try:
            _, stderr = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, stderr = self.process.communicate()
        return stderr


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """generate -> preprocess -> train (quickstart preset, small) through the CLI."""
    root = tmp_path_factory.mktemp("serving")
    raw = root / "raw.tsv"
    hybridrec("generate", "--output", str(raw), "--rows", str(ROWS), "--seed", "11")
    data = root / "data"
    hybridrec("preprocess", "--input", str(raw), "--output", str(data))
    run = root / "run"
    sets = [item for key in SMALL_RUN for item in ("--set", key)]
    hybridrec("train", "--data", str(data), "--run-dir", str(run), "--config", "quickstart", *sets)
    return types.SimpleNamespace(root=root, raw=raw, data=data, run=run)


@pytest.fixture(scope="session")
def exported(trained):
    """`hybridrec export` of the run at fp32: the export base directory."""
    out = trained.root / "export" / "ctr"
    hybridrec("export", "--run", str(trained.run), "--out", str(out), "--precision", "fp32")
    return out


@pytest.fixture(scope="session")
def server(exported, trained):
    """`hybridrec serve` of the fp32 export, with a token."""
    token_file = trained.root / "token"
    token_file.write_text(TOKEN + "\n")
    server = Server(str(exported), "--token-file", str(token_file), "--max-rows", "512")
    yield server
    server.stop()


def reference_predictions(run_dir: Path, data_dir: Path, split: str = "eval"):
    """Per-row probabilities of `split` computed the way `hybridrec evaluate` computes them.

    The checkpoint's embeddings restored into an in-process store, pooled lookups without
    admission, the restored dense state, and `model.make_eval_step` on the 8-device mesh.

    Returns:
        ids [n, F] uint64, dense [n, d] float32, labels [n] float32, probabilities [n] float32.
    """
    import jax

    from embedding_store import EmbeddingStore
    from model import create_train_state, local_rows, make_eval_step, make_global_batch, make_mesh
    from pipeline import read_metadata
    from training.checkpoint import RunCheckpoints
    from training.job import load_config
    from training.tables import plan_tables

    config = load_config(None, [], run_dir)
    metadata = read_metadata(data_dir)
    plan = plan_tables(config.embedding, metadata.categorical)
    checkpoints = RunCheckpoints(run_dir)
    step = checkpoints.latest_step()
    mesh = make_mesh(config.mesh)
    state = create_train_state(
        config.model,
        config.optimizer,
        mesh,
        jax.random.key(config.seed),
        num_dense=len(metadata.dense_columns),
        num_features=len(metadata.categorical),
        embedding_dim=config.embedding.dim,
    )
    state = checkpoints.restore_dense(step, state)
    checkpoints.close()
    eval_step = make_eval_step(config.model, mesh)
    table = pq.read_table(metadata.split_files(split))
    names = [feature.name for feature in metadata.categorical]
    ids = np.stack([table.column(n).to_numpy().astype(np.uint64) for n in names], axis=1)
    dense = np.stack(
        [table.column(n).to_numpy().astype(np.float32) for n in metadata.dense_columns], axis=1
    )
    labels = table.column(metadata.label_column).to_numpy().astype(np.float32)
    batch = 512
    probabilities = []
    with EmbeddingStore.restore(
        checkpoints.embeddings_url, plan.tables, step=step, num_shards=4
    ) as store:
        for start in range(0, len(ids), batch):
            rows = slice(start, min(start + batch, len(ids)))
            count = rows.stop - rows.start
            pad = (-count) % mesh.devices.size
            batch_ids = np.concatenate([ids[rows], np.repeat(ids[rows][:1], pad, 0)])
            batch_dense = np.concatenate([dense[rows], np.repeat(dense[rows][:1], pad, 0)])
            pooled = store.lookup_features(
                {name: batch_ids[:, column] for column, name in enumerate(names)},
                feature_tables=plan.feature_tables,
                pooling=config.embedding.pooling,
                train=False,
            ).result()
            global_batch = make_global_batch(
                {"embeddings": pooled.embeddings, "dense": batch_dense}, mesh
            )
            probabilities.append(local_rows(eval_step(state, global_batch))[:count])
    return ids, dense, labels, np.concatenate(probabilities)


@pytest.fixture(scope="session")
def reference(trained):
    ids, dense, labels, probabilities = reference_predictions(trained.run, trained.data)
    return types.SimpleNamespace(ids=ids, dense=dense, labels=labels, probabilities=probabilities)


@pytest.fixture(scope="session")
def cli():
    """The `hybridrec(*args)` subprocess runner."""
    return hybridrec


@pytest.fixture(scope="session")
def headers():
    """What an authorized client sends."""
    return {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="session")
def start_server():
    """`start_server(*args)`: a `hybridrec serve` subprocess (stop it with `.stop()`)."""
    return Server
