"""Sequence runs through the one trainer, on a generated event log: `hybridrec train` with
the SASRec and HSTU presets beats the popularity baseline, `--resume` continues to the
end, `evaluate --split test` ranks; the evaluation's ranks equal scoring every item in
numpy; bad configurations are one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hybridrec.common.errors import UserError
from hybridrec.pipeline.config import PreprocessConfig
from hybridrec.pipeline.events.event_job import run_event_preprocess
from hybridrec.pipeline.events.synthetic_events import EventLogConfig, generate_events, spec_text
from hybridrec.training.config import load_config
from hybridrec.training.sequences.baselines import evaluate_baselines, ranking_metrics
from hybridrec.training.sequences.batches import Histories
from hybridrec.training.sequences.ranking import query_outputs
from hybridrec.training.tasks import prepare
from hybridrec.training.trainer import Trainer

SMALL = [
    "model.sequence.max_length=32",
    "model.sequence.negatives=64",
    "data.token_budget=1024",
    "optimizer.warmup_steps=10",
    "optimizer.learning_rate=0.003",
    "embedding.optimizer.learning_rate=0.003",
    "log.every_steps=10",
]


def sets(*keys: str) -> list[str]:
    return [item for key in (*SMALL, *keys) for item in ("--set", key)]


def events_dataset(root, config: EventLogConfig | None = None):
    """A generated event log (default: 1,500 users), preprocessed: the dataset's directory."""
    root.mkdir(parents=True, exist_ok=True)
    config = config or EventLogConfig(users=1500, items=400, topics=10, mean_events=15, seed=7)
    generate_events(root / "events.csv", root / "items.csv", config, quiet=True)
    (root / "events.toml").write_text(spec_text("items.csv"))
    out = root / "data"
    settings = PreprocessConfig(
        inputs=[str(root / "events.csv")], output=str(out), spec=str(root / "events.toml")
    )
    run_event_preprocess(settings, quiet=True, beam_args=["--direct_running_mode=in_memory"])
    return out


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    return events_dataset(tmp_path_factory.mktemp("sequence_training"))


def test_sasrec_trains_resumes_and_beats_popularity(events, tmp_path, cli):
    run = tmp_path / "sasrec"
    args = ["train", "--config", "sasrec", "--data", str(events), "--run-dir", str(run)]
    cli(*args, *sets("data.epochs=4", "checkpoint.every_steps=20"))
    first = json.loads((run / "summary.json").read_text())
    cli(*args, "--resume", *sets("data.epochs=8", "checkpoint.every_steps=20"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 * first["steps"]  # the same plan per epoch, continued
    popularity = evaluate_baselines(events, exclude_history=True, split="valid")["popularity"]
    assert summary["eval"]["hr@10"] > popularity["hr@10"] + 0.02, (summary["eval"], popularity)
    assert (
        summary["eval"]["queries"]
        == json.loads((events / "metadata.json").read_text())["splits"]["valid"]["rows"]
    )  # one query per user
    tested = json.loads(cli("evaluate", "--run", str(run), "--split", "test", "--json").stdout)
    assert tested["split"] == "test" and 0 < tested["hr@10"] <= tested["hr@20"] <= 1
    assert tested["ndcg@10"] <= tested["hr@10"]


def test_hstu_preset_trains(events, tmp_path, cli):
    run = tmp_path / "hstu"
    out = cli(
        "train", "--config", "hstu", "--data", str(events), "--run-dir", str(run),
        *sets("data.epochs=2"),
    )  # fmt: skip
    summary = json.loads((run / "summary.json").read_text())
    assert np.isfinite(summary["final_loss"]) and summary["eval"]["hr@10"] > 0
    assert "HR@10" in out.stdout


def test_evaluation_ranks_equal_scoring_every_item(events, tmp_path):
    config = load_config(
        "sasrec",
        [
            f"data.path={json.dumps(str(events))}",
            *SMALL,
            "data.max_steps=15",
            "eval.ranking=sampled_100",
        ],
    )
    trainer = Trainer(config, tmp_path / "run", quiet=True)
    summary = trainer.fit()
    job = prepare(trainer.config)
    from hybridrec.training.checkpoint import RunCheckpoints

    checkpoints = RunCheckpoints(tmp_path / "run", keep=2)
    step = checkpoints.latest_step()
    state = checkpoints.restore_dense(step, job.new_state())
    store = job.open_store(checkpoints, step)
    try:
        histories = Histories.read(job.metadata, "valid")
        outputs, targets, history, position, _, _ = query_outputs(
            job, state, store, job.eval_step(), histories, max_batches=0, progress=None
        )

        def rows(ids):  # as the preset's cosine scores compare them: L2-normalized
            found = (
                store.lookup_features(
                    {"item": ids}, feature_tables=job.tables.feature_tables, train=False
                )
                .result()
                .embeddings[:, 0]
            )
            return found / np.maximum(np.linalg.norm(found, axis=-1, keepdims=True), 1e-6)

        catalogue = job.catalogue.items
        scores = outputs @ rows(catalogue).T  # [queries, items]
        target_scores = np.einsum("qd,qd->q", outputs, rows(targets))
        ranks = []
        for q in range(len(outputs)):
            h = history[q]
            seen = histories.items[histories.offsets[h] : histories.offsets[h] + position[q] + 1]
            candidate = ~np.isin(catalogue, seen) & (catalogue != targets[q])
            ranks.append(int((scores[q][candidate] > target_scores[q]).sum()))
        expected = ranking_metrics(np.array(ranks))
    finally:
        store.close()
        checkpoints.close()
    for key, value in expected.items():
        assert summary["eval"][key] == pytest.approx(value, abs=1e-9), key
    assert 0 < summary["eval"]["hr@10"] <= summary["eval"]["hr@10_sampled100"]


def test_a_mismatched_tower_or_budget_is_one_line(events, dataset, tmp_path):
    def check(path, keys, match):
        config = load_config("sasrec", [f"data.path={json.dumps(str(path))}", *keys])
        with pytest.raises(UserError, match=match):
            prepare(config)

    check(dataset, [], "reads user histories, but .* is a click-log dataset")
    check(events, ["model.tower='dlrm'"], "reads click-log features, but .* holds user histories")
    check(
        events,
        ["data.token_budget=100", "model.sequence.max_length=200"],
        r"data.token_budget = 100 is smaller than one history row \(model.sequence.max_length = 200\)",
    )
    config = load_config(
        "sasrec", [f"data.path={json.dumps(str(events))}", "model.sequence.negatives=100000"]
    )
    with pytest.raises(UserError, match="negatives = 100000 is more than the 4"):
        Trainer(config, tmp_path / "run", quiet=True)


def test_the_python_api_trains_and_evaluates_and_raises_user_errors(events, tmp_path, capsys):
    import hybridrec

    config = hybridrec.load_config("hstu", [*SMALL, "data.max_steps=12"])
    summary = hybridrec.train(config, data=events, run_dir=tmp_path / "run", quiet=True)
    assert summary["steps"] == 12 and summary["tokens_per_s"] > 0
    assert 0 < summary["padding_fraction"] < 0.5
    tested = hybridrec.evaluate(tmp_path / "run", split="test")
    assert tested["split"] == "test" and tested["step"] == 12 and "hr@10" in tested
    with pytest.raises(hybridrec.UserError, match="data.token_budget = 10 is smaller"):
        hybridrec.train(
            hybridrec.load_config("sasrec", ["data.token_budget=10"]),
            data=events,
            run_dir=tmp_path / "bad",
        )
    assert capsys.readouterr().out == ""  # nothing on stdout: the caller's


@pytest.mark.devices(8, launched=True)
@pytest.mark.parametrize("item", ["host", "device", "cache:120"])
def test_two_processes_train_histories_as_one_does(events, tmp_path, cli, item):
    """Each process its share of the packed rows, every process's store replica (or its
    devices' item table, or cache) the whole batch's row gradients: at k = 0 the
    2-process run matches one process on 8 devices."""
    keys = sets("data.max_steps=12", "hybrid.staleness=0", "embedding.num_shards=1")
    keys += ["--set", f"embedding.placement.item={item}"]
    common = ["--data", str(events), "--config", "sasrec", "--quiet", *keys]
    launch = ["launch", "--num-processes", "2", "--devices-per-process", "4", "--timeout", "200"]
    cli(*launch, "--", "train", "--run-dir", str(tmp_path / "two"), *common, timeout=240)
    two = [
        json.loads((tmp_path / "two" / "processes" / f"summary_{i}.json").read_text())
        for i in range(2)
    ]
    assert two[0]["processes"] == 2 and two[0]["steps"] == 12
    assert two[0]["eval"] == two[1]["eval"]  # the same ranks on every process
    eight = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    cli("train", "--run-dir", str(tmp_path / "one"), *common, env=eight)
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert one["devices"] == 8 and one["processes"] == 1
    assert abs(one["final_loss"] - two[0]["final_loss"]) < 1e-3
    assert abs(one["eval"]["hr@10"] - two[0]["eval"]["hr@10"]) < 0.01


def test_histories_train_against_an_embedding_server(events, tmp_path, cli):
    """The item rows on a shard server (`serve-embeddings --config sasrec --data`): the run
    trains them there, its checkpoint holds what the server holds."""
    from hybridrec.embedding_store import EmbeddingStore
    from hybridrec.embedding_store.remote.client import connect

    from hybridrec.cli.server_processes import start_servers, stop_servers

    settings = [*SMALL, "data.max_steps=10"]
    servers = start_servers(
        1, num_shards=2, config="sasrec", data=events, overrides=settings, log_dir=tmp_path
    )
    run = tmp_path / "run"
    try:
        cli(
            "train", "--config", "sasrec", "--data", str(events), "--run-dir", str(run),
            "--quiet", *sets("data.max_steps=10"),
            env={"HYBRIDREC_EMBEDDING_SERVERS": servers[0].address},
        )  # fmt: skip
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == 10 and summary["eval"]["hr@10"] > 0
        job = prepare(load_config("sasrec", [f"data.path={json.dumps(str(events))}", *settings]))
        tables = list(job.tables.tables)
        ids = job.catalogue.items[:500]
        remote = EmbeddingStore(tables, num_shards=2, shards=connect(servers[0].address, tables))
        table = job.tables.feature_tables["item"]
        trained = remote.lookup(table, ids, train=False).result()
        with EmbeddingStore.restore(
            str(run / "checkpoints" / "embeddings"), tables, step=10, num_shards=1
        ) as saved:
            np.testing.assert_array_equal(saved.lookup(table, ids, train=False).result(), trained)
    finally:
        assert stop_servers(servers) == [0]


@pytest.mark.devices(8, launched=True)
@pytest.mark.parametrize("item", ["host", "device"])
def test_two_processes_sharing_an_embedding_server_train_as_one_does(events, tmp_path, cli, item):
    """The PERSIA layout for histories: two trainer processes in front of one embedding
    server (the chief looks up and updates the rows for both; with the item table on the
    devices, the chief writes its rows back) train what one process in front of its own
    server trains, at k = 0: the same loss, ranks and item rows."""
    from hybridrec.embedding_store import EmbeddingStore
    from hybridrec.embedding_store.remote.client import connect

    from hybridrec.cli.server_processes import start_servers, stop_servers

    settings = [*SMALL, "data.max_steps=12", "hybrid.staleness=0"]
    common = ["--data", str(events), "--config", "sasrec", "--quiet"]
    common += sets("data.max_steps=12", "hybrid.staleness=0", f"embedding.placement.item={item}")
    job = prepare(load_config("sasrec", [f"data.path={json.dumps(str(events))}", *settings]))
    tables = list(job.tables.tables)
    table, ids = job.tables.feature_tables["item"], job.catalogue.items[:300]
    runs = {}
    for name, launch in (
        ("two", ["launch", "--num-processes", "2", "--devices-per-process", "4", "--timeout", "200", "--"]),
        ("one", []),
    ):  # fmt: skip
        log_dir = tmp_path / f"servers_{name}"
        log_dir.mkdir()
        servers = start_servers(
            1, num_shards=2, config="sasrec", data=events, overrides=settings, log_dir=log_dir
        )
        try:
            env = {"HYBRIDREC_EMBEDDING_SERVERS": servers[0].address}
            if not launch:
                env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
            cli(*launch, "train", "--run-dir", str(tmp_path / name), *common, env=env, timeout=240)
            remote = EmbeddingStore(
                tables, num_shards=2, shards=connect(servers[0].address, tables)
            )
            runs[name] = remote.lookup(table, ids, train=False).result()
        finally:
            assert stop_servers(servers) == [0]
    two = json.loads((tmp_path / "two" / "processes" / "summary_0.json").read_text())
    other = json.loads((tmp_path / "two" / "processes" / "summary_1.json").read_text())
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert two["processes"] == 2 and two["steps"] == 12 and one["devices"] == 8
    assert two["eval"] == other["eval"]  # the same rows read by both processes
    assert abs(one["final_loss"] - two["final_loss"]) < 1e-3
    assert abs(one["eval"]["hr@10"] - two["eval"]["hr@10"]) < 0.01
    # one update a step reached the server: its rows are the one-process run's (a copy
    # applied by each process would have moved them twice as far)
    np.testing.assert_allclose(runs["two"], runs["one"], atol=1e-4)
    assert np.abs(runs["one"]).max() > 0


@pytest.fixture(scope="module")
def host_runs(events, tmp_path_factory, cli):
    """keys -> the directory of a finished host-store run of SASRec with them (one run per
    set of keys, shared by the tests that compare against it)."""
    runs: dict[tuple[str, ...], Path] = {}

    def run(*keys: str) -> Path:
        if keys not in runs:
            runs[keys] = tmp_path_factory.mktemp("host_run") / "host"
            args = ["--config", "sasrec", "--data", str(events), "--run-dir", str(runs[keys])]
            cli("train", *args, "--quiet", *sets(*keys))
        return runs[keys]

    return run


@pytest.mark.parametrize("placement", ["device/sides", "cache:120", "cache:1000"])
def test_the_item_table_on_the_devices_trains_as_the_host_store_does(
    events, tmp_path, cli, placement, host_runs
):
    """`embedding.placement.item = "device"`: the step gathers the batch's item rows from
    a table on the devices and applies the sparse optimizer to them there ("cache:120":
    a hot-row cache of 120 rows, the other items from the host store, rows moving both
    ways as it admits and evicts; "cache:1000": one that admits every item, the host looking up
    none of a batch's); at k = 0 the run trains the loss, ranks and
    checkpointed rows the host store's run trains, and resumes from its checkpoint to
    the same end ("device/sides": the whole table, with side features, whose rows it holds
    too). The host store's run is shared by the two caches; "cache:1000" does not resume
    (the cache of 120 rows does)."""
    from hybridrec.embedding_store import EmbeddingStore

    placement, sides = placement.split("/") if "/" in placement else (placement, "")
    keys = ["data.max_steps=16", "hybrid.staleness=0", "checkpoint.every_steps=8"]
    if sides:
        keys.append('model.sequence.side_features=["device", "category"]')
    placed = [f"embedding.placement.item={placement}"]
    directories = {"host": host_runs(*keys), "device": tmp_path / "device"}
    args = ["--config", "sasrec", "--data", str(events), "--run-dir", str(directories["device"])]
    cli("train", *args, "--quiet", *sets(*keys, *placed))
    host, device = (json.loads((d / "summary.json").read_text()) for d in directories.values())
    assert not host["device_tables"] and sum(device["device_tables"]["rows"].values()) >= 120
    if placement == "cache:120":  # it held some items, and evicted some for others
        cache = device["device_tables"]["caches"]
        assert (
            min(c["hits"] for c in cache.values()) > 0
            and min(c["evicted"] for c in cache.values()) > 0
        )
    assert abs(host["final_loss"] - device["final_loss"]) < 1e-4
    assert abs(host["eval"]["hr@10"] - device["eval"]["hr@10"]) < 1e-3
    settings = [f"data.path={json.dumps(str(events))}", *SMALL]
    job = prepare(load_config("sasrec", settings))
    tables, table = list(job.tables.tables), job.tables.feature_tables["item"]
    ids = job.catalogue.items[:400]
    saved = {}
    for name, directory in directories.items():
        url = str(directory / "checkpoints" / "embeddings")
        with EmbeddingStore.restore(url, tables, step=16, num_shards=1) as store:
            saved[name] = store.lookup(table, ids, train=False).result()
    np.testing.assert_allclose(saved["device"], saved["host"], atol=1e-5)
    if placement == "cache:1000":
        return
    # stopped at step 8 and resumed: the device table is loaded from the checkpoint
    resumed = tmp_path / "resumed"
    args = ["--config", "sasrec", "--data", str(events), "--run-dir", str(resumed), "--quiet"]
    cli("train", *args, *sets(*keys, *placed, "data.max_steps=8"))
    cli("train", *args, "--resume", *sets(*keys, *placed))
    again = json.loads((resumed / "summary.json").read_text())
    assert again["steps"] == 16 and abs(again["final_loss"] - device["final_loss"]) < 1e-4


def test_the_ranking_objective_learns_the_next_events_action(events, tmp_path):
    """DLRMv3's form: BCE per action type of the next event, AUC and NE per action in
    evaluation."""
    import hybridrec

    config = hybridrec.load_config(
        "sasrec", [*SMALL, "data.epochs=10", "model.sequence.objective=ranking"]
    )
    summary = hybridrec.train(config, data=events, run_dir=tmp_path / "run", quiet=True)
    evaluation = summary["eval"]
    for action in ("view", "click", "like", "skip"):  # the generator's action types
        assert 0 <= evaluation[f"auc_{action}"] <= 1 and evaluation[f"ne_{action}"] > 0
    assert "hr@10" not in evaluation  # retrieval is not this run's objective
    # the head learned the actions of the events it trained on (on this generator the
    # held-out events' actions follow the user's topics only weakly)
    trained = hybridrec.evaluate(tmp_path / "run", split="train")
    assert trained["auc"] > 0.6, trained
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["sequence"]["actions"] == 4
    with pytest.raises(hybridrec.UserError, match="has none"):
        no_actions = tmp_path / "no_actions"
        no_actions.mkdir()
        import shutil

        shutil.copytree(events, no_actions / "data")
        meta = json.loads((no_actions / "data" / "metadata.json").read_text())
        meta["spec"]["action_types"] = []
        (no_actions / "data" / "metadata.json").write_text(json.dumps(meta))
        hybridrec.train(config, data=no_actions / "data", run_dir=tmp_path / "bad", quiet=True)
