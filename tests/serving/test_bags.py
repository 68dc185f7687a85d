"""Multi-valued (bag) features served as training pools them.

A small CSV with two multi-valued columns (`tags`, `genres`) and two single-valued
ones, described by a spec file, goes through the real `preprocess`, `train` (mean
pooling), `export` and `serve`; every eval row's probability through raw rows and
through hashed bags equals `evaluate`'s within float32 rounding (tolerance.PARITY).
"""

from __future__ import annotations

import json
import types

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from hybridrec.embedding_store import EmbeddingStore, RaggedIds, TableConfig
from hybridrec.serving.bags import pool_bags

from .tolerance import PARITY

TOLERANCE = PARITY
ROWS = 3000
SPEC = """name = "bags"
delimiter = ","
columns = ["clicked", "price", "age", "user", "item", "tags", "genres"]
label = "clicked"
dense = ["price", "age"]
dense_type = "float64"

[[categorical]]
name = "user"

[[categorical]]
name = "tags"
multi_valued = true
separator = "|"

[[categorical]]
name = "item"

[[categorical]]
name = "genres"
table = "genre"
multi_valued = true
separator = ";"
"""
RUN = [
    "model.dlrm.bottom_mlp=[16, 8]",
    "model.dlrm.top_mlp=[32, 16]",
    "embedding.dim=8",
    "embedding.capacity=50000",
    "embedding.pooling=mean",
    "data.batch_size=128",
    "data.shuffle_buffer=1024",
    "log.every_steps=10",
    "checkpoint.every_steps=0",
    "eval.every_steps=0",
]


def _row(rng: np.random.Generator, index: int) -> str:
    tags = [f"t{int(t)}" for t in rng.zipf(1.5, size=rng.integers(0, 5)) if t < 60]
    if rng.random() < 0.05:
        tags.insert(0, "")  # an empty value inside a bag: the feature's missing id
    genres = ";".join(f"g{int(g)}" for g in rng.integers(0, 12, size=rng.integers(0, 3)))
    price = "" if rng.random() < 0.1 else f"{rng.gamma(2.0, 10.0):.2f}"
    clicked = int(("t1" in tags) ^ (rng.random() < 0.2))
    age = int(rng.integers(18, 80))
    return (
        f"{clicked},{price},{age},u{index},i{int(rng.integers(0, 200))},{'|'.join(tags)},{genres}"
    )


@pytest.fixture(scope="module")
def bags(tmp_path_factory, cli, start_server, headers):
    """preprocess -> train -> export -> serve of a CSV with bags; evaluate's answers."""
    from hybridrec.serving.reference import evaluate_rows

    root = tmp_path_factory.mktemp("bags")
    spec = root / "bags.toml"
    spec.write_text(SPEC)
    rng = np.random.default_rng(3)
    lines = [_row(rng, index) for index in range(ROWS)]
    raw = root / "bags.csv"
    raw.write_text("\n".join(lines) + "\n")
    data, run, out = root / "data", root / "run", root / "export" / "bags"
    cli("preprocess", "--input", str(raw), "--output", str(data), "--spec", str(spec))
    sets = [item for key in RUN for item in ("--set", key)]
    cli("train", "--data", str(data), "--run-dir", str(run), "--config", "quickstart", *sets)
    cli("export", "--run", str(run), "--out", str(out), "--precision", "fp32")
    ids, dense, labels, probabilities = evaluate_rows(run, data)  # spec order: tags 2nd
    token_file = root / "token"
    token_file.write_text(headers["Authorization"].split()[1])
    server = start_server(str(out), "--token-file", str(token_file))
    yield types.SimpleNamespace(
        lines=lines,
        data=data,
        run=run,
        out=out,
        ids=ids,
        dense=dense,
        labels=labels,
        probabilities=probabilities,
        server=server,
    )
    server.stop()


def _eval_lines(bags) -> list[str]:
    """The raw line of every eval row, in Parquet order (each row's user is unique)."""
    from hybridrec.pipeline import RowEncoder, load_spec

    encoder = RowEncoder(load_spec(bags.out.parent.parent / "bags.toml"))
    users = encoder.encode(bags.lines).ids["user"]
    line_of = {int(user): line for user, line in zip(users, bags.lines, strict=True)}
    return [line_of[int(user)] for user in bags.ids["user"]]


def _hashed_inputs(bags, start: int, stop: int) -> dict[str, np.ndarray]:
    """What a client sends for rows [start, stop): single ids, bags as ids + lengths, dense."""
    inputs = {
        "ids": np.stack([bags.ids["user"][start:stop], bags.ids["item"][start:stop]], axis=1),
        "dense": bags.dense[start:stop],
    }
    for name in ("tags", "genres"):
        offsets = bags.ids[name].offsets
        inputs[f"{name}.ids"] = bags.ids[name].values[offsets[start] : offsets[stop]]
        inputs[f"{name}.lengths"] = np.diff(offsets[start : stop + 1])
    return inputs


def _json_inputs(arrays: dict[str, np.ndarray]) -> list[dict]:
    types_ = {np.dtype(np.uint64): "UINT64", np.dtype(np.int64): "INT64"}
    return [
        {
            "name": name,
            "shape": list(array.shape),
            "datatype": types_.get(array.dtype, "FP32"),
            "data": array.reshape(-1).tolist(),
        }
        for name, array in arrays.items()
    ]


def test_export_records_kinds_and_pooling(bags):
    features = json.loads((bags.out / "1" / "features.json").read_text())
    assert features["feature_kinds"] == {
        "user": "single",
        "tags": "multi",
        "item": "single",
        "genres": "multi",
    }
    assert features["pooling"] == "mean"
    assert set(features["feature_tables"]) == {"user", "tags", "item", "genres"}


def _evaluate_matches_the_reference(cli, run, data) -> None:
    """`hybridrec evaluate`'s metrics of `run` equal those of `evaluate_rows`, which
    feeds the tower the features in spec order, as serving does."""

    from hybridrec.model import StreamingMetrics
    from hybridrec.serving.reference import evaluate_rows

    _, _, labels, probabilities = evaluate_rows(run, data)
    result = json.loads(cli("evaluate", "--run", str(run), "--json").stdout)
    metrics = StreamingMetrics()
    metrics.update(probabilities, labels)
    assert int(result["count"]) == len(probabilities)
    assert abs(float(metrics.result()["auc"]) - result["auc"]) < 1e-9
    assert abs(float(metrics.result()["logloss"]) - result["logloss"]) < 1e-6


@pytest.mark.parametrize("placement", ["devices", "host"])
def test_evaluate_feeds_the_features_in_spec_order_whatever_the_placement(
    bags, cli, tmp_path, placement
):
    """A bag in the middle of the spec (`tags`, 2nd of 4) reaches the tower in the spec's
    order with the tables on the devices (the module's run) and on the host store alone:
    training and `evaluate` once put the single-valued features first on the host."""
    run = bags.run
    if placement == "devices":
        summary = json.loads((run / "summary.json").read_text())
        assert summary["device_tables"]["rows"], summary["device_tables"]
    if placement == "host":
        run = tmp_path / "host"
        sets = [item for key in RUN for item in ("--set", key)]
        sets += ["--set", "embedding.device_budget=0", "--set", "data.max_steps=12"]
        cli("train", "--data", str(bags.data), "--run-dir", str(run), "--config", "quickstart", *sets)  # fmt: skip
    _evaluate_matches_the_reference(cli, run, bags.data)


def test_served_model_equals_evaluate(bags):
    from hybridrec.serving import ServedModel

    model = ServedModel(bags.out, max_batch=64)
    try:
        assert isinstance(bags.ids["tags"], RaggedIds)
        lengths = np.diff(bags.ids["tags"].offsets)
        missing = np.uint64(2 << 56)  # an empty field: a bag of the feature's missing id
        assert (
            lengths.min() == 1 and lengths.max() >= 3 and (bags.ids["tags"].values == missing).any()
        )
        served, unseen = model.predict(bags.ids, bags.dense)
        np.testing.assert_allclose(served, bags.probabilities, rtol=0, atol=TOLERANCE)
        assert unseen.shape == (len(served),)
        ids, dense = model.encode_rows(_eval_lines(bags))
        np.testing.assert_array_equal(dense, bags.dense)
        for name in ("tags", "genres"):
            np.testing.assert_array_equal(ids[name].values, bags.ids[name].values)
            np.testing.assert_array_equal(ids[name].offsets, bags.ids[name].offsets)
        with pytest.raises(ValueError, match="multi-valued"):
            model.predict(np.zeros((2, 4), np.uint64), bags.dense[:2])
    finally:
        model.close()


def test_raw_rows_and_hashed_bags_over_http_equal_evaluate(bags, headers):
    lines = _eval_lines(bags)
    rows = len(lines)
    served_raw, served_json = [], []
    with httpx.Client(timeout=60) as client:
        for start in range(0, rows, 200):
            stop = min(start + 200, rows)
            for inputs, served in (
                (
                    [
                        {
                            "name": "rows",
                            "datatype": "BYTES",
                            "shape": [stop - start],
                            "data": lines[start:stop],
                        }
                    ],
                    served_raw,
                ),  # fmt: skip
                (_json_inputs(_hashed_inputs(bags, start, stop)), served_json),
            ):
                response = client.post(
                    f"{bags.server.url}/v2/models/bags/infer",
                    json={"inputs": inputs},
                    headers=headers,
                )
                assert response.status_code == 200, response.text
                served.extend(response.json()["outputs"][0]["data"])
    for served in (served_raw, served_json):
        np.testing.assert_allclose(served, bags.probabilities, rtol=0, atol=TOLERANCE)

    # binary tensors from a real client of the protocol
    client = triton.InferenceServerClient(bags.server.url.removeprefix("http://"))
    arrays = _hashed_inputs(bags, 0, rows)
    tensors = []
    for name, array in arrays.items():
        datatype = "FP32" if name == "dense" else triton.np_to_triton_dtype(array.dtype)
        tensor = triton.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    result = client.infer("bags", tensors, headers=dict(headers)).as_numpy("probabilities")
    np.testing.assert_allclose(result, bags.probabilities, rtol=0, atol=TOLERANCE)


def test_concurrent_requests_batched_together(bags, headers):
    """Raw and hashed requests of 8 clients share batches; each gets its own rows back."""
    from concurrent.futures import ThreadPoolExecutor

    lines = _eval_lines(bags)
    url = f"{bags.server.url}/v2/models/bags/infer"
    bad_line = "1,2.0,30,u1,i1"  # two fields short: fails its own request only

    def request(start: int) -> tuple[int, int, list[float]]:
        stop = start + 7
        if start % 3 == 0:
            inputs = [
                {"name": "rows", "datatype": "BYTES", "shape": [7], "data": lines[start:stop]}
            ]
        elif start % 3 == 1:
            inputs = _json_inputs(_hashed_inputs(bags, start, stop))
        else:
            inputs = [
                {
                    "name": "rows",
                    "datatype": "BYTES",
                    "shape": [2],
                    "data": [lines[start], bad_line],
                }
            ]
        with httpx.Client(timeout=60) as client:
            response = client.post(url, json={"inputs": inputs}, headers=headers)
        data = response.json()["outputs"][0]["data"] if response.status_code == 200 else []
        return start, response.status_code, data

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(request, range(0, 7 * 40, 7)))
    for start, status, data in answers:
        if start % 3 == 2:
            assert status == 400
            continue
        assert status == 200
        np.testing.assert_allclose(
            data, bags.probabilities[start : start + 7], rtol=0, atol=TOLERANCE
        )


def test_one_batch_of_raw_hashed_and_bad_requests(bags):
    """Raw rows and hashed bags of several requests run as one batch; a bad row fails alone."""
    import asyncio

    from hybridrec.serving import ServedModel
    from hybridrec.serving.bags import slice_rows
    from hybridrec.serving.batching import DynamicBatcher

    lines = _eval_lines(bags)
    model = ServedModel(bags.out, max_batch=32)

    async def run():
        batcher = DynamicBatcher(max_batch=5 + 4 + 2 + 6, max_delay=60.0)
        batcher.start()
        try:
            return await asyncio.gather(
                batcher.predict(model, lines=lines[0:5]),
                batcher.predict(model, ids=slice_rows(bags.ids, 5, 9), dense=bags.dense[5:9]),
                batcher.predict(model, lines=[lines[9], "0,1.0,20,u9,i9"]),
                batcher.predict(model, lines=lines[11:17]),
                return_exceptions=True,
            ), batcher.batches
        finally:
            await batcher.stop()

    try:
        answers, batches = asyncio.run(run())
    finally:
        model.close()
    assert batches == 1
    assert "row 1: wrong_field_count" in str(answers[2])
    for (start, stop), answer in zip(
        [(0, 5), (5, 9), (11, 17)], [answers[i] for i in (0, 1, 3)], strict=True
    ):
        np.testing.assert_allclose(
            answer[0], bags.probabilities[start:stop], rtol=0, atol=TOLERANCE
        )


BAD_BAGS = [
    # (what is changed, expected status, a phrase of the error)
    ("lengths sum", 400, "sums to"),
    ("negative length", 400, "negative bag size"),
    ("lengths shape", 400, "'tags.lengths' must have shape [4]"),
    ("missing lengths", 400, "'tags.lengths' [n]"),
    ("ids of every feature", 400, "'ids' must have shape [n, 2]"),
    ("bag ids as FP32", 400, "'genres.ids' must be INT64 or UINT64"),
    ("bag ids 2-D", 400, "'tags.ids' must have shape [nnz]"),
    ("huge length", 400, "has a bag of"),
]


@pytest.mark.parametrize(("change", "status", "phrase"), BAD_BAGS)
def test_bad_bag_input_is_a_4xx_and_the_server_keeps_serving(bags, headers, change, status, phrase):
    arrays = _hashed_inputs(bags, 0, 4)
    inputs = {tensor["name"]: tensor for tensor in _json_inputs(arrays)}
    tags = inputs["tags.lengths"]
    if change == "lengths sum":
        tags["data"][0] += 1
    elif change == "negative length":
        tags["data"][0], tags["data"][1] = -1, tags["data"][1] + tags["data"][0] + 1
    elif change == "lengths shape":
        tags["data"], tags["shape"] = tags["data"][:3], [3]
    elif change == "missing lengths":
        del inputs["tags.lengths"]
    elif change == "ids of every feature":
        inputs["ids"] = _json_inputs({"ids": np.zeros((4, 4), np.uint64)})[0]
    elif change == "bag ids as FP32":
        inputs["genres.ids"]["datatype"] = "FP32"
    elif change == "huge length":
        # four bags of 2**62 ids and more: an int64 sum wraps around to the true count
        tags["data"] = [2**62] * 3 + [2**62 + sum(tags["data"])]
    elif change == "bag ids 2-D":
        count = len(inputs["tags.ids"]["data"])
        inputs["tags.ids"]["shape"] = [1, count]
    url = f"{bags.server.url}/v2/models/bags/infer"
    with httpx.Client(timeout=60) as client:
        response = client.post(url, json={"inputs": list(inputs.values())}, headers=headers)
        assert response.status_code == status, response.text
        assert phrase in response.json()["error"]
        good = client.post(url, json={"inputs": _json_inputs(arrays)}, headers=headers)
        assert good.status_code == 200, good.text
        np.testing.assert_allclose(
            good.json()["outputs"][0]["data"], bags.probabilities[:4], rtol=0, atol=TOLERANCE
        )


def test_metadata_lists_bag_inputs(bags, headers):
    answer = httpx.get(f"{bags.server.url}/v2/models/bags", headers=headers).json()
    names = [tensor["name"] for tensor in answer["inputs"]]
    assert names == [
        "rows",
        "ids",
        "tags.ids",
        "tags.lengths",
        "genres.ids",
        "genres.lengths",
        "dense",
    ]
    assert answer["inputs"][1]["shape"] == [-1, 2]
    assert answer["parameters"]["pooling"] == "mean"


def test_unseen_and_empty_bags(bags, headers):
    """Unseen ids in a bag get the default row and are counted; an empty bag pools to zeros."""
    from hybridrec.serving import ServedModel

    arrays = _hashed_inputs(bags, 0, 4)
    url = f"{bags.server.url}/v2/models/bags/infer"
    with httpx.Client(timeout=60) as client:
        before = client.post(url, json={"inputs": _json_inputs(arrays)}, headers=headers).json()
        unseen = np.array([(2 << 56) + 7_777_777, (2 << 56) + 7_777_778], np.uint64)
        first = int(arrays["tags.lengths"][0])
        arrays["tags.ids"] = np.concatenate([unseen, arrays["tags.ids"][first:]])
        arrays["tags.lengths"][0] = 2  # row 0's bag: two ids the export lacks
        arrays["genres.ids"] = arrays["genres.ids"][int(arrays["genres.lengths"][0]) :]
        arrays["genres.lengths"][0] = 0  # row 0's genres: an empty bag
        after = client.post(url, json={"inputs": _json_inputs(arrays)}, headers=headers)
    assert after.status_code == 200, after.text
    after = after.json()
    assert after["parameters"]["unseen_ids"] == before["parameters"]["unseen_ids"] + 2
    np.testing.assert_array_equal(
        after["outputs"][0]["data"][1:], before["outputs"][0]["data"][1:]
    )  # the other rows of the batch are untouched
    model = ServedModel(bags.out, max_batch=8)
    try:
        ids = {
            "user": arrays["ids"][:, 0],
            "tags": RaggedIds(
                values=arrays["tags.ids"],
                offsets=np.concatenate([[0], np.cumsum(arrays["tags.lengths"])]),
            ),
            "item": arrays["ids"][:, 1],
            "genres": RaggedIds(
                values=arrays["genres.ids"],
                offsets=np.concatenate([[0], np.cumsum(arrays["genres.lengths"])]),
            ),
        }
        embeddings, counted = model.embeddings(ids)
        assert counted.tolist()[0] == 3  # the two tags, and the user (unique to each row)
        assert not embeddings[0, 3].any()  # genres is feature 3: empty bag -> zeros
        assert embeddings[0, 1].any()  # two unseen tags: the initializer's rows, averaged
        probabilities, _ = model.predict(ids, arrays["dense"])
        np.testing.assert_allclose(
            probabilities, after["outputs"][0]["data"], rtol=0, atol=TOLERANCE
        )
    finally:
        model.close()


@pytest.mark.parametrize("pooling", ["sum", "mean", "sqrtn"])
def test_pool_bags_equals_the_store_pooling(pooling):
    """Bit-for-bit the store's `lookup_features` pooling, empty bags included."""
    table = TableConfig(name="tags", dim=4, capacity=1000)
    rng = np.random.default_rng(0)
    values = rng.integers(1, 50, size=40).astype(np.uint64)
    lengths = np.array([0, 3, 1, 0, 7, 2, 5, 10, 12, 0])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    with EmbeddingStore([table], num_shards=1) as store:
        store.lookup("tags", np.unique(values), train=True).result()  # admit every id
        pooled = store.lookup_features(
            {"tags": RaggedIds(values=values, offsets=offsets)},
            feature_tables={"tags": "tags"},
            pooling=pooling,
            train=False,
        ).result()
        rows = store.lookup("tags", values, train=False).result()
    expected = pooled.embeddings[:, 0]
    np.testing.assert_array_equal(pool_bags(rows, offsets, pooling), expected)
    assert not expected[lengths == 0].any() and expected[lengths > 0].any()
