"""Serving a sequence run: the export answers what `hybridrec evaluate` computes.

A SASRec run (retrieval and ranking objectives) on a generated event log is exported;
the served top-K of the validation histories equals scoring every catalogue item with
evaluate's own query vectors and rows, history excluded or kept; the ranking head's
probabilities equal evaluate's logits; int8 rows keep recall@100 against fp32; raw item
ids go in and come out; kept histories answer as the explicit ones; every bad request is
a 4xx naming its input, and the server keeps serving.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import types

import numpy as np
import pytest
from hybridrec.pipeline.events.synthetic_events import EventLogConfig
from hybridrec.serving.export import export_run
from hybridrec.serving.sequence_model import ServedSequenceModel
from hybridrec.serving.server import ServeOptions, create_app
from hybridrec.training.checkpoint import RunCheckpoints
from hybridrec.training.config import load_config
from hybridrec.training.sequences.batches import Histories
from hybridrec.training.sequences.ranking import query_outputs
from hybridrec.training.tasks import prepare
from hybridrec.training.trainer import Trainer
from starlette.testclient import TestClient

from tests.training.test_sequence_training import events_dataset

SMALL = [
    "model.sequence.max_length=16",
    "model.sequence.negatives=64",
    "model.sequence.objective=both",
    "model.sequence.action_inputs=0",  # requests of items only (tests/serving/test_sequence_context.py: more)
    "data.token_budget=1024",
    "data.max_steps=30",
    "optimizer.learning_rate=0.003",
    "embedding.optimizer.learning_rate=0.003",
    "log.every_steps=10",
]


@contextlib.contextmanager
def restored(config, run_dir):
    """(job, state, store) of a finished run's newest checkpoint, closed afterwards."""
    job = prepare(config)
    checkpoints = RunCheckpoints(run_dir, keep=2)
    step = checkpoints.latest_step()
    state = checkpoints.restore_dense(step, job.new_state())
    store = job.open_store(checkpoints, step)
    try:
        yield job, state, store
    finally:
        store.close()
        checkpoints.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A trained SASRec run, its fp32 and int8 exports, and evaluate's queries of the
    validation split (outputs, targets, histories, ranking logits)."""
    root = tmp_path_factory.mktemp("sequence_serving")
    config = EventLogConfig(users=800, items=300, topics=8, mean_events=14, seed=5)
    data = events_dataset(root, config)
    config = load_config("sasrec", [f"data.path={json.dumps(str(data))}", *SMALL])
    trainer = Trainer(config, root / "run", quiet=True)
    trainer.fit()
    with restored(trainer.config, root / "run") as (job, state, store):
        histories = Histories.read(job.metadata, "valid")
        outputs, targets, history, position, ranking, _ = query_outputs(
            job, state, store, job.eval_step(), histories, max_batches=0, progress=None
        )
        rows = (
            store.lookup_features(
                {"item": job.catalogue.items}, feature_tables=job.tables.feature_tables, train=False
            )
            .result()
            .embeddings[:, 0]
        )
    users = [
        histories.items[histories.offsets[h] : histories.offsets[h] + p + 1]
        for h, p in zip(history, position, strict=True)
    ]
    fp32 = export_run(root / "run", root / "export", quiet=True)["path"]
    int8 = export_run(root / "run", root / "export_int8", precision="int8", quiet=True)["path"]
    return types.SimpleNamespace(
        root=root,
        fp32=fp32,
        int8=int8,
        outputs=outputs,
        targets=targets,
        ranking=ranking,
        users=users,
        catalogue=job.catalogue.items,
        rows=rows,
    )


def scored(rows: np.ndarray) -> np.ndarray:
    """Rows as the preset's cosine scores compare them: L2-normalized."""
    return rows / np.maximum(np.linalg.norm(rows, axis=-1, keepdims=True), 1e-6)


def reference_top_k(run, k: int, exclude: bool) -> np.ndarray:
    """[Q, k] catalogue items by evaluate's scores, best first, ties in catalogue order."""
    scores = run.outputs @ scored(run.rows).T
    if exclude:
        for q, history in enumerate(run.users):
            scores[q, np.isin(run.catalogue, history)] = -np.inf
    return run.catalogue[np.argsort(-scores, axis=1, kind="stable")[:, :k]]


@pytest.mark.parametrize("exclude", [True, False])
def test_served_top_k_equals_scoring_every_item_with_evaluates_queries(run, exclude):
    model = ServedSequenceModel(run.fp32, max_batch=64)
    queries, truncated, unseen = model.encode(run.users)
    np.testing.assert_allclose(queries, run.outputs, rtol=1e-5, atol=1e-5)
    assert not unseen.any()
    items, scores = model.top_k(queries, 10, run.users if exclude else None)
    expected = reference_top_k(run, 10, exclude)
    assert np.mean(np.all(items == expected, axis=1)) >= 0.99
    assert np.all(np.diff(scores, axis=1) <= 0)  # best first
    if exclude:
        assert not any(np.isin(row, h).any() for row, h in zip(items, run.users, strict=True))
    assert len(truncated) == sum(len(h) > 16 for h in run.users) > 0  # max_length 16


def test_recommend_answers_raw_ids_as_the_server(run):
    import hybridrec

    model = hybridrec.load_model(run.fp32)
    histories = [model.item_names(h) for h in run.users[:4]]
    answers = model.recommend(histories, k=5)
    expected = reference_top_k(run, 5, exclude=True)[:4]
    assert [[item for item, _ in row] for row in answers] == [
        model.item_names(row) for row in expected
    ]
    assert all(a[1] >= b[1] for row in answers for a, b in zip(row, row[1:], strict=False))
    with pytest.raises(ValueError, match="at least one item"):
        model.recommend([[]])


def test_int8_rows_keep_recall_at_100(run):
    fp32 = ServedSequenceModel(run.fp32, max_batch=64)
    int8 = ServedSequenceModel(run.int8, max_batch=64)
    exact, _ = fp32.top_k(fp32.encode(run.users)[0], 100)
    quantized, _ = int8.top_k(int8.encode(run.users)[0], 100)
    recall = np.mean(
        [len(np.intersect1d(a, b)) / 100 for a, b in zip(exact, quantized, strict=True)]
    )
    assert recall >= 0.99, recall


def test_ranking_probabilities_equal_evaluates_logits(run):
    model = ServedSequenceModel(run.fp32, max_batch=64)
    scores, _, _ = model.score_candidates(run.users, run.targets[:, None])
    expected = 1 / (1 + np.exp(-run.ranking.astype(np.float64)))
    np.testing.assert_allclose(scores[:, 0], expected, rtol=1e-4, atol=1e-5)


def tensor(name, values, datatype="BYTES", shape=None):
    return {
        "name": name,
        "datatype": datatype,
        "shape": shape or [len(values)],
        "data": values,
    }


@pytest.fixture(scope="module")
def client(run):
    model = ServedSequenceModel(run.fp32, max_batch=64)
    options = ServeOptions(keep_histories=12, max_users=50, max_body_bytes=20_000)
    with TestClient(create_app(model, run.root / "export", options)) as client:
        client.model = model
        yield client


def test_raw_ids_in_and_out_over_the_protocol(run, client):
    model = client.model
    users = run.users[:5]
    names = [model.item_names(h) for h in users]
    body = {
        "inputs": [
            tensor("history", [n for h in names for n in h]),
            tensor("lengths", [len(h) for h in names], "INT64"),
        ],
        "parameters": {"k": 5},
    }
    answer = client.post("/v2/models/export/infer", json=body).json()
    items = answer["outputs"][0]
    assert items["shape"] == [5, 5]
    expected = reference_top_k(run, 5, exclude=True)[:5]
    assert items["data"] == model.item_names(expected)
    assert all(name.startswith("i") for name in items["data"])  # the generator's raw ids
    assert answer["parameters"]["truncated"] == [i for i, h in enumerate(users) if len(h) > 16]


def test_kept_histories_answer_as_the_explicit_ones(run, client):
    model = client.model
    history = model.item_names(run.users[0])
    for start in range(0, len(history), 3):  # appended a few at a time
        part = history[start : start + 3]
        events = {"inputs": [tensor("users", ["alice"] * len(part)), tensor("items", part)]}
        assert client.post("/v2/models/export/events", json=events).status_code == 200
    kept = history[-12:]  # the last 12 events are kept
    by_user = {"inputs": [tensor("users", ["alice"])], "parameters": {"k": 7}}
    explicit = {"inputs": [tensor("history", kept)], "parameters": {"k": 7}}
    first = client.post("/v2/models/export/infer", json=by_user).json()
    second = client.post("/v2/models/export/infer", json=explicit).json()
    assert first["outputs"] == second["outputs"]
    # the least recently used users are evicted beyond max_users, and counted
    names = [f"user-{i}" for i in range(60)]
    events = {"inputs": [tensor("users", names), tensor("items", [history[0]] * 60)]}
    stats = client.post("/v2/models/export/events", json=events).json()
    assert stats["kept_users"] == 50 and stats["evicted_users"] == 11  # alice, then 10
    assert stats["kept_events"] == 50  # one event each: the count follows evictions
    gone = client.post("/v2/models/export/infer", json=by_user)
    assert gone.status_code == 404 and "alice" in gone.json()["error"]


def test_a_kept_history_computes_only_its_new_events(run, client):
    longer = next(h for h in run.users if len(h) >= 8)
    history = client.model.item_names(longer)[:8]

    def append(items):
        events = {"inputs": [tensor("users", ["carol"] * len(items)), tensor("items", items)]}
        assert client.post("/v2/models/export/events", json=events).status_code == 200

    def ask(body):
        answer = client.post("/v2/models/export/infer", json=body).json()
        return answer["parameters"]["computed_events"], answer["outputs"]

    by_user = {"inputs": [tensor("users", ["carol"])], "parameters": {"k": 6}}
    append(history[:5])
    assert ask(by_user)[0] == 5  # the first request computes the whole history
    assert ask(by_user)[0] == 0  # nothing new: the cached query
    append(history[5:8])
    computed, cached = ask(by_user)
    assert computed == 3  # only the new events
    explicit = {"inputs": [tensor("history", history)], "parameters": {"k": 6}}
    fresh_computed, fresh = ask(explicit)
    assert fresh_computed == 8
    assert cached[0] == fresh[0]  # the same items
    np.testing.assert_allclose(cached[1]["data"], fresh[1]["data"], rtol=1e-5, atol=1e-5)
    assert client.get("/v2/models/export/stats").json()["histories"]["cached_users"] >= 1


def test_a_delta_export_serves_what_a_full_one_does(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run.root / "run", copy)
    export_run(copy, tmp_path / "export", quiet=True)  # version 1: the run's step
    config = load_config(None, ["data.max_steps=36"], copy)  # its config, further
    Trainer(config, copy, resume=True, quiet=True).fit()
    delta = export_run(copy, tmp_path / "export", delta_from=1, quiet=True)
    assert delta["kind"] == "delta" and delta["base_version"] == 1
    full = export_run(copy, tmp_path / "full", quiet=True)
    served, reference = (
        ServedSequenceModel(p, max_batch=64) for p in (delta["path"], full["path"])
    )
    queries = served.encode(run.users)[0]
    np.testing.assert_array_equal(queries, reference.encode(run.users)[0])
    items, _ = served.top_k(queries, 10, run.users)
    np.testing.assert_array_equal(items, reference.top_k(queries, 10, run.users)[0])


BAD = [
    ({"inputs": [tensor("history", [])]}, 400, "empty"),
    ({"inputs": [tensor("history", ["i1"])], "parameters": {"k": 0}}, 400, "'k'"),
    ({"inputs": [tensor("history", ["i1"])], "parameters": {"k": 10**6}}, 400, "catalogue"),
    (
        {"inputs": [tensor("history", ["i1"]), tensor("candidates", [3], "INT64", [1, 1])]},
        400,
        "'candidates' must be BYTES",
    ),
    (
        {"inputs": [tensor("history", ["i1"]), tensor("candidates", ["i2", "i3"], shape=[2, 1])]},
        400,
        "'candidates' must have shape [1, C >= 1]",
    ),
    (
        {"inputs": [tensor("history", ["i1", "i2"]), tensor("lengths", [1, 2], "INT64")]},
        400,
        "'lengths'",
    ),
    ({"inputs": [tensor("history", ["i1"] * 5000)]}, 413, "limit"),
    ({"inputs": [tensor("items", ["i1"])]}, 400, "unknown input"),
]


@pytest.mark.parametrize(("body", "status", "message"), BAD)
def test_bad_requests_are_4xx_naming_the_input(client, body, status, message):
    response = client.post("/v2/models/export/infer", json=body)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]
    good = {"inputs": [tensor("history", ["i1", "i2"])], "parameters": {"k": 3}}
    assert client.post("/v2/models/export/infer", json=good).status_code == 200


def test_unknown_users_without_kept_histories_and_unseen_items(run):
    model = ServedSequenceModel(run.fp32, max_batch=8)
    with TestClient(create_app(model, run.root / "export", ServeOptions())) as client:
        response = client.post(
            "/v2/models/export/infer", json={"inputs": [tensor("users", ["bob"])]}
        )
        assert response.status_code == 400 and "keeps no histories" in response.json()["error"]
        # items never trained are scored from their initial rows, not refused
        body = {
            "inputs": [tensor("history", ["never-seen-1", "never-seen-2"])],
            "parameters": {"k": 3},
        }
        answer = client.post("/v2/models/export/infer", json=body).json()
        assert answer["parameters"]["unseen_items"] == 2
        assert answer["outputs"][0]["shape"] == [1, 3]
        events = client.post(
            "/v2/models/export/events",
            json={"inputs": [tensor("users", ["bob"]), tensor("items", ["i1"])]},
        )
        assert events.status_code == 400 and "--keep-histories" in events.json()["error"]
