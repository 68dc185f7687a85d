"""Remote shard servers as real processes: SIGKILL and restart from a checkpoint in the
middle of a training-like loop, graceful SIGTERM, the command line."""

import json
import logging
import threading

import numpy as np
import pytest
from hybridrec.common.errors import UserError
from hybridrec.embedding_store import EmbeddingStore, RaggedIds, TableConfig, shard_of
from hybridrec.embedding_store.config import load_tables
from hybridrec.embedding_store.remote.client import connect
from hybridrec.embedding_store.remote.shard_server import ShardServer

from hybridrec.cli._embedding_servers import embedding_servers
from hybridrec.cli.serve_embeddings import main, parse_shard_list, training_tables
from hybridrec.cli.server_processes import start_server_process, start_servers, stop_servers

TABLES_TOML = """
[[tables]]
name = "ads"
dim = 4
capacity = 5000
[tables.optimizer]
name = "adagrad"
learning_rate = 0.1

[[tables]]
name = "users"
dim = 4
capacity = 5000
[tables.optimizer]
name = "rowwise_adagrad"
"""
UNIVERSE = np.arange(400, dtype=np.uint64)


@pytest.fixture
def tables_file(tmp_path):
    path = tmp_path / "tables.toml"
    path.write_text(TABLES_TOML)
    return path


@pytest.fixture
def processes():
    """Server processes started by a test; killed at teardown whatever happened."""
    started = []
    yield started
    for server in started:
        server.kill()


def _train_step(store, step, rng):
    """One step of a training-like loop: pooled lookup of two features, then its update."""
    store.set_step(step)
    ids = rng.integers(0, len(UNIVERSE), size=96).astype(np.uint64)
    features = {"ad": ids[:32], "user": RaggedIds(ids[32:], np.arange(0, 65, 2, dtype=np.int64))}
    pooled = store.lookup_features(features, feature_tables={"ad": "ads", "user": "users"}).result()
    grads = rng.normal(size=pooled.embeddings.shape).astype(np.float32)
    store.apply_pooled_gradients(pooled, grads).result()


def _rows(store, table="ads"):
    return store.lookup(table, UNIVERSE, train=False).result().copy()


def test_killed_server_restarts_from_its_checkpoint_and_training_resumes(
    tables_file, tmp_path, processes, caplog
):
    tables = load_tables(tables_file)
    logs = tmp_path / "logs"
    logs.mkdir()
    processes.extend(
        start_servers(2, num_shards=2, tables=tables_file, token="t0ken", log_dir=logs)
    )
    assert [server.shards for server in processes] == [[0], [1]]
    addresses = [server.address for server in processes]
    store = EmbeddingStore(
        tables, shards=connect(addresses, tables, token="t0ken", retry_timeout=60)
    )
    rng = np.random.default_rng(0)
    url = str(tmp_path / "embeddings")
    for step in range(1, 5):
        _train_step(store, step, rng)
    store.checkpoint(url, 4)
    at_checkpoint = _rows(store)
    for step in range(5, 8):
        _train_step(store, step, rng)
    before_kill = _rows(store)
    on_killed = shard_of(UNIVERSE, 2) == 0
    assert not np.array_equal(before_kill[on_killed], at_checkpoint[on_killed])

    processes[0].kill()  # SIGKILL: no drain, no goodbye
    after_restart = {}
    reader = threading.Thread(target=lambda: after_restart.update(rows=_rows(store)))
    with caplog.at_level(logging.WARNING, logger="embedding_store.remote.client"):
        reader.start()  # retries with backoff while the server is down
        port = int(addresses[0].rsplit(":", 1)[1])
        processes[0] = start_server_process(
            tables_file,
            num_shards=2,
            shards=[0],
            port=port,
            token="t0ken",
            restore=url,
            log_path=logs / "server0-restarted.log",
        )
        reader.join(timeout=60)
    rows = after_restart["rows"]
    # Lost: exactly the updates to the killed server's shard since its checkpoint.
    np.testing.assert_array_equal(rows[on_killed], at_checkpoint[on_killed])
    np.testing.assert_array_equal(rows[~on_killed], before_kill[~on_killed])
    assert "restarted from its checkpoint at step 4" in caplog.text
    assert store.shards[0].connection.restarts == 1

    # Training resumes, and the next (incremental) checkpoint is consistent.
    for step in range(8, 11):
        _train_step(store, step, rng)
    result = store.checkpoint(url, 10)
    assert not result["full"]
    restored = EmbeddingStore.restore(url, tables, num_shards=3)
    for table in ("ads", "users"):
        np.testing.assert_array_equal(_rows(restored, table), _rows(store, table))
    restored.close()

    # A health probe, then SIGTERM: the server drains and exits 0.
    token_file = str(_token(tmp_path))
    assert main(["--check", processes[1].address, "--token-file", token_file]) == 0
    assert main(["--stats", processes[0].address, "--token-file", token_file]) == 0
    store.close()
    assert stop_servers(processes) == [0, 0]
    log = (logs / "embedding-server-1.log").read_text()
    assert "stopping: finishing in-flight updates" in log
    assert main(["--check", processes[1].address]) == 1


def _token(tmp_path):
    path = tmp_path / "token"
    path.write_text("t0ken\n")
    return path


def test_drain_finishes_an_update_in_flight():
    tables = [TableConfig(name=name, dim=4, capacity=10**6) for name in ("ads", "users")]
    server = ShardServer(tables, [0], num_shards=1)
    try:
        (shard,) = connect([f"127.0.0.1:{server.port}"], tables)
        ids = np.arange(300_000, dtype=np.uint64)
        grads = np.ones((len(ids), 4), np.float32)
        done = threading.Event()
        errors = []

        def update():
            try:
                shard.apply_gradients({"ads": (ids, grads), "users": (ids, grads)})
            except Exception as error:  # noqa: BLE001 - asserted below
                errors.append(error)
            done.set()

        threading.Thread(target=update).start()
        while not done.is_set() and server.stats()["pending_updates"] == 0:
            pass
        in_flight = not done.is_set()
        server.drain_and_stop(timeout=60)
        done.wait(60)
        assert errors == []
        stats = server.stats()
        assert stats["counters"]["rows_applied"] == 2 * len(ids)
        assert stats["pending_updates"] == 0
        if in_flight:  # the usual case: the drain waited for it
            assert stats["rows"] == 2 * len(ids)
    finally:
        server.drain_and_stop(timeout=5)


def test_command_line_errors(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[tables]]\nname = "ads"\ndim = 4\ncapacty = 10\n')
    with pytest.raises(UserError, match=r"bad.toml: .*unknown config key tables\[0\].capacty"):
        load_tables(bad)
    with pytest.raises(UserError, match="exited with status 2"):
        start_server_process(bad, num_shards=1, log_path=tmp_path / "log", ready_timeout=60)
    assert "did you mean" in (tmp_path / "log").read_text()
    with pytest.raises(UserError, match="--shards"):
        main(["--tables", str(bad), "--num-shards", "2", "--shards", "0,5"])


def test_tables_from_the_training_preset(tmp_path):
    """`--config P --data D --set k=v`: the tables `hybridrec train` builds, in its order."""
    data = tmp_path / "data"
    data.mkdir()
    spec = {
        "label": "label",
        "dense": ["I1"],
        "categorical": [
            {"name": "C1", "table": "ads", "multi_valued": False},
            {"name": "C2", "table": "users", "multi_valued": True, "separator": ","},
            {"name": "C3", "table": "ads", "multi_valued": False},
        ],
    }
    splits = {name: {"files": [], "rows": 1000} for name in ("train", "eval")}
    metadata = {"format_version": 1, "spec": spec, "splits": splits}
    (data / "metadata.json").write_text(json.dumps(metadata))
    (data / "_SUCCESS").write_text("")
    settings = ["embedding.dim=8", "embedding.capacity=1000"]
    (fused,) = training_tables("quickstart", str(data), settings)  # embedding.fuse_tables
    assert (fused.name, fused.dim, fused.capacity) == ("embeddings", 8, 2000)
    tables = training_tables("quickstart", str(data), [*settings, "embedding.fuse_tables=false"])
    assert [(table.name, table.dim) for table in tables] == [("ads", 8), ("users", 8)]
    assert tables[0].optimizer.name == "adagrad"  # from the preset's [embedding.optimizer]
    with pytest.raises(UserError, match="unknown config key embedding.dimm"):
        training_tables("quickstart", str(data), ["embedding.dimm=8"])


def test_server_addresses_config_first_then_environment(monkeypatch):
    monkeypatch.delenv("HYBRIDREC_EMBEDDING_SERVERS", raising=False)
    monkeypatch.delenv("HYBRIDREC_EMBEDDING_RETRY_TIMEOUT", raising=False)
    none = embedding_servers(None)
    assert none.addresses == () and none.source == "" and none.retry_timeout == 60.0
    monkeypatch.setenv("HYBRIDREC_EMBEDDING_SERVERS", "h:7001,h:7002")
    monkeypatch.setenv("HYBRIDREC_EMBEDDING_RETRY_TIMEOUT", "3")
    from_environment = embedding_servers([])
    assert from_environment.addresses == ("grpc://h:7001", "grpc://h:7002")
    assert from_environment.source == "$HYBRIDREC_EMBEDDING_SERVERS"
    assert from_environment.retry_timeout == 3.0
    configured = embedding_servers(["x:1"])  # the config wins over the environment
    assert configured.addresses == ("grpc://x:1",) and configured.source == "embedding.servers"
    monkeypatch.setenv("HYBRIDREC_EMBEDDING_RETRY_TIMEOUT", "soon")
    with pytest.raises(UserError, match="HYBRIDREC_EMBEDDING_RETRY_TIMEOUT='soon'"):
        embedding_servers(None)
    assert parse_shard_list("0-2,5", 8) == [0, 1, 2, 5]
    with pytest.raises(UserError, match="--shards: \\[9\\] outside 0..7"):
        parse_shard_list("1,9", 8)
