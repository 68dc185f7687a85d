"""Side features as tower inputs (`model.sequence.side_features`), from training to
serving: an event's feature (the generated log's device) and its item's (category), whose
rows share the item table and are added to each event's item row.

The batches point each position at its side ids; training gives those ids rows in the
store; the served queries of the test histories, with each event's device, equal
evaluate's (the item's category from the export's item_sides.parquet); another device
gives another query; a request without the device, or an unknown feature in the config,
names it, as training's start-up does an event feature named like a request's own input;
kept histories keep each event's device.
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
from hybridrec.common.errors import UserError
from hybridrec.pipeline.config import PreprocessConfig
from hybridrec.pipeline.events.event_job import run_event_preprocess
from hybridrec.pipeline.events.synthetic_events import (
    DEVICES,
    EventLogConfig,
    generate_events,
    spec_text,
)
from hybridrec.serving.export import export_run
from hybridrec.serving.sequence_model import ServedSequenceModel
from hybridrec.serving.server import ServeOptions, create_app
from hybridrec.training.config import load_config
from hybridrec.training.sequences.batches import Histories
from hybridrec.training.sequences.ranking import query_outputs
from hybridrec.training.tasks import prepare
from hybridrec.training.trainer import Trainer
from starlette.testclient import TestClient

from tests.serving.test_sequence_context import SMALL as CONTEXT_SMALL
from tests.serving.test_sequence_serving import restored, tensor
from tests.training.test_sequence_training import events_dataset

SIDES = ("device", "category")
SMALL = [  # the context test's run, reading the side features instead of times and actions
    *CONTEXT_SMALL,
    "model.sequence.time_buckets=0",
    "model.sequence.action_inputs=0",
    f"model.sequence.side_features={json.dumps(list(SIDES))}",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A trained HSTU run reading the device and category of each event, its export, and
    evaluate's queries of the test split with each history's side ids."""
    root = tmp_path_factory.mktemp("sequence_sides")
    data = events_dataset(root, EventLogConfig(users=600, items=300, topics=8, mean_events=14, seed=6))  # fmt: skip
    config = load_config("hstu", [f"data.path={json.dumps(str(data))}", *SMALL])
    trainer = Trainer(config, root / "run", quiet=True)
    trainer.fit()
    with restored(trainer.config, root / "run") as (job, state, store):
        histories = Histories.read(job.metadata, "test", sides=SIDES)
        outputs, _, history, position, _, _ = query_outputs(
            job, state, store, job.eval_step(), histories, max_batches=0, progress=None
        )
        side_ids = np.concatenate([np.unique(histories.sides[name]) for name in SIDES])
        trained = store.lookup_features({"item": side_ids}, feature_tables=job.tables.feature_tables, pooling="sum", train=False).result()  # fmt: skip

    def upto(values, h, p):
        return values[histories.offsets[h] : histories.offsets[h] + p + 1]

    pairs = list(zip(history, position, strict=True))
    return types.SimpleNamespace(
        root=root,
        data=data,
        export=export_run(root / "run", root / "export", quiet=True)["path"],
        outputs=outputs,
        side_rows=trained.embeddings[:, 0],
        users=[upto(histories.items, h, p) for h, p in pairs],
        devices=[upto(histories.sides["device"], h, p).view(np.int64) for h, p in pairs],
        histories=histories,
    )


def test_batches_point_each_position_at_its_side_ids(run):
    config = load_config("hstu", [f"data.path={json.dumps(str(run.data))}", *SMALL])
    job = prepare(config)
    reader, _ = job.reader("train", batch_size=job.config.data.batch_size, train=True)
    batch = next(iter(reader.batches(1)))
    ids, sides = batch.ids["item"], batch.arrays["sides"]
    histories = job.histories
    assert sides.shape == (*batch.arrays["inputs"].shape, len(SIDES))
    # every real position's side ids are its input event's
    row, column = np.nonzero(batch.arrays["segments"] >= 0)
    segment = batch.arrays["segments"][row, column]
    source = histories.offsets[batch.histories[segment]] + batch.starts[segment] + batch.arrays["positions"][row, column]  # fmt: skip
    assert (ids[batch.arrays["inputs"][row, column]] == histories.items[source]).all()
    for index, name in enumerate(SIDES):
        assert (ids[sides[row, column, index]] == histories.sides[name][source]).all()


def test_side_rows_are_trained_in_the_item_table(run):
    # looked up without admitting: a side id the run never trained would have its
    # initial row; every one was trained, so none is all its initial value (the run has
    # 3 devices and a handful of categories, each seen at thousands of positions)
    assert len(run.side_rows) >= 4
    assert np.all(np.abs(run.side_rows).sum(axis=1) > 0)
    assert np.isfinite(run.side_rows).all()


def test_served_queries_with_side_features_equal_evaluates(run):
    model = ServedSequenceModel(run.export, max_batch=64)
    assert model.reads == ("device",) and model.context == ()
    queries, _, _ = model.encode(run.users, {"device": run.devices})
    np.testing.assert_allclose(queries, run.outputs, rtol=1e-5, atol=1e-5)
    codes = model.sides.event_ids("device", [name.encode() for name in DEVICES]).view(np.int64)
    other = [np.where(d == codes[0], codes[1], codes[0]) for d in run.devices]
    changed, _, _ = model.encode(run.users, {"device": other})
    assert np.abs(changed - run.outputs).max() > 1e-3
    with pytest.raises(ValueError, match="reads each event's device"):
        model.encode(run.users[:1], {})
    # the item's category comes with the item, for every item of the dataset's splits (a
    # test input need not be a training item); an item outside item_sides gets the
    # category table's missing id, as the event job gives an item without features
    (categories,) = model.sides.of_items(run.histories.items)
    assert (categories == run.histories.sides["category"]).all()
    (missing,) = model.sides.of_items(np.array([12345], np.uint64))
    assert missing[0] >> np.uint64(56) == np.uint64(4)  # category's prefix, no low bits
    assert missing[0] & np.uint64((1 << 56) - 1) == 0


def test_requests_carry_side_features_and_kept_histories_keep_them(run):
    model = ServedSequenceModel(run.export, max_batch=64)
    names_of = dict(zip(model.sides.event_ids("device", [n.encode() for n in DEVICES]).view(np.int64).tolist(), DEVICES, strict=True))  # fmt: skip
    with TestClient(create_app(model, run.root / "export", ServeOptions(keep_histories=16, max_users=50))) as client:  # fmt: skip
        url = "/v2/models/export"
        described = client.get(url).json()
        assert described["parameters"]["side_features"] == ["device"]
        assert {"name": "device", "datatype": "BYTES", "shape": [-1]} in described["inputs"]
        index = next(i for i, h in enumerate(run.users) if 6 <= len(h) <= 16)
        names = model.item_names(run.users[index])
        devices = [names_of[int(d)] for d in run.devices[index]]
        explicit = {"inputs": [tensor("history", names), tensor("device", devices)], "parameters": {"k": 5}}  # fmt: skip
        answer = client.post(f"{url}/infer", json=explicit).json()
        expected = model.scan.top_k(run.outputs[index : index + 1], 5, [run.users[index]])
        assert model.item_ids([n.encode() for n in answer["outputs"][0]["data"]]).tolist() == expected[0][0].tolist()  # fmt: skip
        missing = client.post(f"{url}/infer", json={"inputs": [tensor("history", names)]})
        assert missing.status_code == 400 and "'device'" in missing.json()["error"]
        # kept with each event's device, a few at a time: the same answer
        for start in range(0, len(names), 4):
            part = slice(start, start + 4)
            events = {"inputs": [tensor("users", ["dan"] * len(names[part])), tensor("items", names[part]), tensor("device", devices[part])]}  # fmt: skip
            assert client.post(f"{url}/events", json=events).status_code == 200
        kept = client.post(f"{url}/infer", json={"inputs": [tensor("users", ["dan"])], "parameters": {"k": 5}}).json()  # fmt: skip
        assert kept["outputs"][0] == answer["outputs"][0]
        bare = {"inputs": [tensor("users", ["eve"]), tensor("items", names[:1])]}
        assert client.post(f"{url}/events", json=bare).status_code == 200
        refused = client.post(f"{url}/infer", json={"inputs": [tensor("users", ["eve"])]})
        assert refused.status_code == 400 and "without device" in refused.json()["error"]


def test_an_unknown_side_feature_is_named(run):
    config = load_config("hstu", [f"data.path={json.dumps(str(run.data))}", *SMALL, 'model.sequence.side_features=["colour"]'])  # fmt: skip
    with pytest.raises(UserError, match=r"side_features: 'colour' is not .* device, category, brand"):  # fmt: skip
        prepare(config)


def test_an_event_feature_named_like_a_request_input_is_refused_at_start_up(tmp_path):
    """A served request sends an event feature by its name, beside its own inputs: the
    trainer refuses one named "history" before it trains, not the export after."""
    config = EventLogConfig(users=60, items=40, topics=4, mean_events=6, seed=1)
    generate_events(tmp_path / "events.csv", tmp_path / "items.csv", config, quiet=True)
    events = (tmp_path / "events.csv").read_text().split("\n", 1)
    (tmp_path / "events.csv").write_text(events[0].replace("device", "history") + "\n" + events[1])
    (tmp_path / "events.toml").write_text(spec_text("items.csv").replace('"device"', '"history"'))
    settings = PreprocessConfig(
        inputs=[str(tmp_path / "events.csv")],
        output=str(tmp_path / "data"),
        spec=str(tmp_path / "events.toml"),
    )
    run_event_preprocess(settings, quiet=True, beam_args=["--direct_running_mode=in_memory"])
    data = f"data.path={json.dumps(str(tmp_path / 'data'))}"
    config = load_config("hstu", [data, *SMALL, 'model.sequence.side_features=["history"]'])
    with pytest.raises(UserError, match=r"event feature 'history' .* a served request's own input"):  # fmt: skip
        prepare(config)
    prepare(load_config("hstu", [data, *SMALL, 'model.sequence.side_features=["brand"]']))
