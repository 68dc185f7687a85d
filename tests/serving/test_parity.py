"""Served predictions equal `hybridrec evaluate`'s, through both input paths and two clients."""

from __future__ import annotations

import json

import httpx
import numpy as np
import tritonclient.http as triton
from hybridrec.model import StreamingMetrics
from hybridrec.pipeline import RowEncoder, read_metadata, spec_from_json

from .kserve import id_and_dense_inputs
from .tolerance import PARITY

TOLERANCE = PARITY
CHUNK = 256


def _infer(client: httpx.Client, url: str, inputs: list[dict], headers: dict) -> dict:
    response = client.post(
        f"{url}/v2/models/ctr/infer", json={"inputs": inputs}, headers=dict(headers)
    )
    assert response.status_code == 200, response.text
    return response.json()


def _eval_lines(trained, reference):
    """The raw lines of the eval split, in the order of its Parquet rows.

    Lines are matched to Parquet rows by their ids: every eval row must be found, so
    the row encoder hashes exactly as the Beam job did.
    """
    spec = spec_from_json(read_metadata(trained.data).raw["spec"])
    lines = [line for line in trained.raw.read_bytes().split(b"\n") if line]
    encoder = RowEncoder(spec)
    position = {}
    for start in range(0, len(lines), 4096):
        chunk = lines[start : start + 4096]
        try:
            encoded = encoder.encode(chunk)
        except Exception:  # noqa: BLE001 - generated logs hold a few malformed rows
            encoded = None
        if encoded is None:
            for offset, line in enumerate(chunk):
                try:
                    one = encoder.encode([line])
                except Exception:  # noqa: BLE001
                    continue
                key = tuple(one.ids[f.name][0] for f in spec.categorical)
                position[key] = (start + offset, one.dense[0])
            continue
        ids = np.stack([encoded.ids[f.name] for f in spec.categorical], axis=1)
        for offset, row in enumerate(ids):
            position[tuple(row)] = (start + offset, encoded.dense[offset])
    matched = [position.get(tuple(row)) for row in reference.ids]
    assert all(m is not None for m in matched), "eval rows whose raw line hashes differently"
    dense = np.stack([m[1] for m in matched])
    np.testing.assert_array_equal(dense, reference.dense)  # the same dense transform
    return [lines[m[0]].decode() for m in matched]


def test_reference_is_what_evaluate_reports(trained, reference, cli):
    result = json.loads(cli("evaluate", "--run", str(trained.run), "--json").stdout)
    metrics = StreamingMetrics()
    metrics.update(reference.probabilities, reference.labels)
    assert int(result["count"]) == len(reference.probabilities)
    assert abs(float(metrics.result()["auc"]) - result["auc"]) < 1e-9
    assert abs(float(metrics.result()["logloss"]) - result["logloss"]) < 1e-6


def test_hashed_and_raw_inputs_equal_evaluate(server, trained, reference, headers):
    lines = _eval_lines(trained, reference)
    served_ids, served_rows = [], []
    with httpx.Client(timeout=60) as client:
        for start in range(0, len(lines), CHUNK):
            rows = slice(start, start + CHUNK)
            ids, dense = reference.ids[rows], reference.dense[rows]
            answer = _infer(client, server.url, id_and_dense_inputs(ids, dense), headers)
            assert answer["outputs"][0]["name"] == "probabilities"
            assert answer["outputs"][0]["datatype"] == "FP32"
            served_ids.append(answer["outputs"][0]["data"])
            # every other chunk without the label column, as rows to score arrive
            chunk = lines[rows]
            if (start // CHUNK) % 2:
                chunk = [line.split("\t", 1)[1] for line in chunk]  # label is column 0
            answer = _infer(
                client,
                server.url,
                [{"name": "rows", "datatype": "BYTES", "shape": [len(chunk)], "data": chunk}],
                headers,
            )
            served_rows.append(answer["outputs"][0]["data"])
    by_ids = np.concatenate(served_ids).astype(np.float32)
    by_rows = np.concatenate(served_rows).astype(np.float32)
    assert len(by_ids) == len(reference.probabilities) > 500
    assert np.max(np.abs(by_ids - reference.probabilities)) <= TOLERANCE
    assert np.max(np.abs(by_rows - reference.probabilities)) <= TOLERANCE


def test_triton_client_both_paths(server, trained, reference, headers):
    lines = _eval_lines(trained, reference)[:300]
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("ctr", headers=dict(headers))
    metadata = client.get_model_metadata("ctr", headers=dict(headers))
    assert metadata["outputs"][0]["name"] == "probabilities"
    for binary in (True, False):
        ids = triton.InferInput("ids", list(reference.ids[:300].shape), "UINT64")
        ids.set_data_from_numpy(reference.ids[:300], binary_data=binary)
        dense = triton.InferInput("dense", list(reference.dense[:300].shape), "FP32")
        dense.set_data_from_numpy(reference.dense[:300], binary_data=binary)
        output = triton.InferRequestedOutput("probabilities", binary_data=binary)
        result = client.infer("ctr", [ids, dense], outputs=[output], headers=dict(headers))
        probabilities = result.as_numpy("probabilities")
        assert probabilities.dtype == np.float32 and probabilities.shape == (300,)
        assert np.max(np.abs(probabilities - reference.probabilities[:300])) <= TOLERANCE

        rows = triton.InferInput("rows", [len(lines)], "BYTES")
        rows.set_data_from_numpy(np.array(lines, dtype=object), binary_data=binary)
        result = client.infer("ctr", [rows], outputs=[output], headers=dict(headers))
        assert (
            np.max(np.abs(result.as_numpy("probabilities") - reference.probabilities[:300]))
            <= TOLERANCE
        )
    client.close()


def test_demo_score_serves_rows_over_http(exported, trained, reference):
    from hybridrec.serving import demo_score

    lines = _eval_lines(trained, reference)[:5]
    scores = demo_score(exported, lines)
    assert len(scores) == 5
    assert np.max(np.abs(np.asarray(scores, np.float32) - reference.probabilities[:5])) <= TOLERANCE


def test_the_python_api_predicts_raw_rows_as_evaluate(exported, trained, reference):
    import hybridrec

    model = hybridrec.load_model(exported)
    lines = _eval_lines(trained, reference)[:64]
    probabilities = model.predict_rows(lines)
    assert np.max(np.abs(probabilities - reference.probabilities[:64])) <= TOLERANCE
    model.close()
