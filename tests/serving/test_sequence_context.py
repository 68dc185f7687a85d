"""Serving an HSTU run that reads more of each event than its item: its time (the
time-gap bias) and its action type (an input row a type).

The served queries of the validation histories, with their times and actions, equal
evaluate's; times and actions change the answer; a request without them, or with an
unknown action type, is a 400 naming the input; kept histories keep their events' times
and actions (a kept history extended from its cache answers as the explicit one), and kept
events appended without them are a 400 for this model. The dataset's event feature this
model does not read (the device) is accepted and ignored; a name the dataset lacks is a 400.
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
from hybridrec.pipeline.events.synthetic_events import EventLogConfig
from hybridrec.serving.export import export_run
from hybridrec.serving.sequence_model import ServedSequenceModel
from hybridrec.serving.server import ServeOptions, create_app
from hybridrec.training.config import load_config
from hybridrec.training.sequences.batches import Histories
from hybridrec.training.sequences.ranking import query_outputs
from hybridrec.training.trainer import Trainer
from starlette.testclient import TestClient

from tests.serving.test_sequence_serving import restored, tensor
from tests.training.test_sequence_training import events_dataset

SMALL = [
    "model.sequence.max_length=16",
    "model.sequence.negatives=64",
    "data.token_budget=1024",
    "data.max_steps=30",
    "optimizer.learning_rate=0.003",
    "embedding.optimizer.learning_rate=0.003",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A trained HSTU run (the time-gap bias and action inputs on: the generated log has
    times and action types), its export, and evaluate's queries of the validation split
    with each history's times and actions."""
    root = tmp_path_factory.mktemp("sequence_times")
    data = events_dataset(root, EventLogConfig(users=600, items=300, topics=8, mean_events=14, seed=6))  # fmt: skip
    config = load_config("hstu", [f"data.path={json.dumps(str(data))}", *SMALL])
    trainer = Trainer(config, root / "run", quiet=True)
    sequence = trainer.config.model.sequence
    assert sequence.time_buckets == 64 and sequence.action_inputs == 4  # auto, from the data
    trainer.fit()
    with restored(trainer.config, root / "run") as (job, state, store):
        histories = Histories.read(job.metadata, "valid", times=True)
        outputs, _, history, position, _, _ = query_outputs(
            job, state, store, job.eval_step(), histories, max_batches=0, progress=None
        )

    def upto(values, h, p):
        return values[histories.offsets[h] : histories.offsets[h] + p + 1]

    pairs = list(zip(history, position, strict=True))
    return types.SimpleNamespace(
        root=root,
        export=export_run(root / "run", root / "export", quiet=True)["path"],
        outputs=outputs,
        users=[upto(histories.items, h, p) for h, p in pairs],
        times=[upto(histories.times, h, p) for h, p in pairs],
        actions=[upto(histories.actions, h, p).astype(np.int64) for h, p in pairs],
    )


def test_served_queries_with_times_and_actions_equal_evaluates(run):
    model = ServedSequenceModel(run.export, max_batch=64)
    assert model.context == ("times", "actions")
    context = {"times": run.times, "actions": run.actions}
    queries, _, _ = model.encode(run.users, context)
    np.testing.assert_allclose(queries, run.outputs, rtol=1e-5, atol=1e-5)
    # the gaps count, not the origin; other gaps, or other actions, give other queries
    shifted, _, _ = model.encode(run.users, {**context, "times": [t + 86_400 for t in run.times]})
    np.testing.assert_allclose(shifted, run.outputs, rtol=1e-5, atol=1e-5)
    spread, _, _ = model.encode(run.users, {**context, "times": [t * 50 for t in run.times]})
    assert np.abs(spread - run.outputs).max() > 1e-3
    other = [a % 4 + 1 for a in run.actions]
    changed, _, _ = model.encode(run.users, {**context, "actions": other})
    assert np.abs(changed - run.outputs).max() > 1e-3
    with pytest.raises(ValueError, match="reads each event's time"):
        model.encode(run.users[:1], {"actions": run.actions[:1]})
    with pytest.raises(ValueError, match="reads each event's action type"):
        model.encode(run.users[:1], {"times": run.times[:1]})


def test_requests_carry_times_and_actions_and_kept_histories_keep_them(run):
    model = ServedSequenceModel(run.export, max_batch=64)
    options = ServeOptions(keep_histories=16, max_users=50)
    with TestClient(create_app(model, run.root / "export", options)) as client:
        url = "/v2/models/export"
        assert client.get(url).json()["parameters"]["context"] == ["times", "actions"]
        history = next(h for h in run.users if 6 <= len(h) <= 16)
        index = next(i for i, h in enumerate(run.users) if h is history)
        names, stamps = model.item_names(history), [int(t) for t in run.times[index]]
        kinds = [model.action_types[a - 1] for a in run.actions[index]]
        explicit = {
            "inputs": [
                tensor("history", names),
                tensor("times", stamps, "INT64"),
                tensor("actions", kinds),
            ],
            "parameters": {"k": 5},
        }
        answer = client.post(f"{url}/infer", json=explicit).json()
        scores = np.asarray(answer["outputs"][1]["data"])
        items = model.item_ids([n.encode() for n in answer["outputs"][0]["data"]])
        expected = model.scan.top_k(run.outputs[index : index + 1], 5, [history])
        assert (items == expected[0][0]).all()
        np.testing.assert_allclose(scores, expected[1][0], rtol=1e-5, atol=1e-5)
        for name in ("times", "actions"):
            partial = {"inputs": [i for i in explicit["inputs"] if i["name"] != name]}
            missing = client.post(f"{url}/infer", json=partial)
            assert missing.status_code == 400 and f"{name!r}" in missing.json()["error"]
        unknown = {"inputs": [*explicit["inputs"][:2], tensor("actions", ["buy"] * len(names))]}
        refused = client.post(f"{url}/infer", json=unknown)
        assert refused.status_code == 400 and "'buy'" in refused.json()["error"]
        # the dataset's device, which this model does not read, is accepted and ignored (a
        # client may send one payload to every version); a name the dataset lacks is not
        parameters = client.get(url).json()["parameters"]
        assert parameters["side_features"] == [] and parameters["event_features"] == ["device"]
        devices = tensor("device", ["tv"] * len(names))
        ignored = client.post(f"{url}/infer", json={**explicit, "inputs": [*explicit["inputs"], devices]})  # fmt: skip
        assert ignored.status_code == 200 and ignored.json()["outputs"] == answer["outputs"]
        colour = client.post(f"{url}/infer", json={**explicit, "inputs": [*explicit["inputs"], {**devices, "name": "colour"}]})  # fmt: skip
        assert colour.status_code == 400 and "unknown input(s) ['colour']" in colour.json()["error"]
        context = {"times": [stamps], "actions": [kinds]}
        assert model.recommend([names], 5, **context, sides={"device": [["tv"] * len(names)]}) == model.recommend([names], 5, **context)  # fmt: skip
        with pytest.raises(ValueError, match="'colour' is not an event feature of this model's dataset"):  # fmt: skip
            model.recommend([names], 5, **context, sides={"colour": [["red"] * len(names)]})
        # kept with their times, a few at a time: the cache extends, the answer is the same
        for start in range(0, len(names), 4):
            part = slice(start, start + 4)
            events = {"inputs": [tensor("users", ["dan"] * len(names[part])), tensor("items", names[part]), tensor("times", stamps[part], "INT64"), tensor("actions", kinds[part]), tensor("device", ["tv"] * len(names[part]))]}  # fmt: skip
            assert client.post(f"{url}/events", json=events).status_code == 200
            kept = client.post(f"{url}/infer", json={"inputs": [tensor("users", ["dan"])], "parameters": {"k": 5}}).json()  # fmt: skip
        assert kept["outputs"][0] == answer["outputs"][0]
        assert kept["parameters"]["computed_events"] == len(names) - start
        np.testing.assert_allclose(kept["outputs"][1]["data"], scores, rtol=1e-5, atol=1e-5)
        untimed = {"inputs": [tensor("users", ["eve"]), tensor("items", names[:1]), tensor("actions", kinds[:1])]}  # fmt: skip
        assert client.post(f"{url}/events", json=untimed).status_code == 200
        refused = client.post(f"{url}/infer", json={"inputs": [tensor("users", ["eve"])]})
        assert refused.status_code == 400 and "without times" in refused.json()["error"]
