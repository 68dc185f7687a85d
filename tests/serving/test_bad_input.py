"""Every bad request gets a 4xx `{"error": ...}` and the server keeps serving; bad exports refuse to load."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import numpy as np
import pytest
from hybridrec.serving import ExportError, ServedModel


def _row(trained) -> str:
    return next(line for line in trained.raw.read_text().split("\n") if line)


def _bad_requests(trained):
    """(description, body bytes, expected status, words the error must contain)."""
    row = _row(trained)
    rows = lambda data, **extra: json.dumps(  # noqa: E731
        {
            "inputs": [
                {"name": "rows", "datatype": "BYTES", "shape": [len(data)], "data": data, **extra}
            ]
        }
    ).encode()
    ids_input = {"name": "ids", "datatype": "UINT64", "shape": [1, 26], "data": [1] * 26}
    dense_input = {"name": "dense", "datatype": "FP32", "shape": [1, 13], "data": [0.5] * 13}
    hashed = lambda *inputs: json.dumps({"inputs": list(inputs)}).encode()  # noqa: E731
    return [
        ("malformed JSON", b'{"inputs": [', 400, "malformed JSON"),
        ("not an object", b"[1, 2]", 400, "JSON object"),
        ("no inputs", b"{}", 400, "'inputs'"),
        (
            "wrong tensor name",
            json.dumps(
                {"inputs": [{"name": "lines", "datatype": "BYTES", "shape": [1], "data": [row]}]}
            ).encode(),
            400,
            "'rows'",
        ),
        (
            "wrong datatype of rows",
            json.dumps(
                {"inputs": [{"name": "rows", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
            ).encode(),
            400,
            "BYTES",
        ),
        (
            "unknown datatype",
            json.dumps(
                {"inputs": [{"name": "rows", "datatype": "STRING", "shape": [1], "data": [row]}]}
            ).encode(),
            400,
            "datatype",
        ),
        (
            "shape and data disagree",
            json.dumps(
                {"inputs": [{"name": "rows", "datatype": "BYTES", "shape": [2], "data": [row]}]}
            ).encode(),
            400,
            "shape",
        ),
        ("wrong field count", rows(["1\t2\t3"]), 400, "wrong_field_count"),
        ("non-numeric dense", rows([row, row.replace("\t", "\tx", 1)]), 400, "row 1"),
        ("no rows", rows([]), 400, "at least one row"),
        ("too many rows", rows([row] * 513), 413, "limit"),
        (
            "ids of the wrong width",
            hashed({**ids_input, "shape": [1, 25], "data": [1] * 25}, dense_input),
            400,
            "[n, 26]",
        ),
        (
            "dense of the wrong type",
            hashed(ids_input, {**dense_input, "datatype": "INT64", "data": [1] * 13}),
            400,
            "FP32",
        ),
        (
            "ids and dense disagree",
            hashed({**ids_input, "shape": [2, 26], "data": [1] * 52}, dense_input),
            400,
            "rows",
        ),
        ("ids without dense", hashed(ids_input), 400, "either"),
        ("non-finite dense", hashed(ids_input, {**dense_input, "data": [1e39] * 13}), 400, "dense"),
        ("negative UINT64", hashed({**ids_input, "data": [-1] * 26}, dense_input), 400, "range"),
        (
            "unknown output",
            json.dumps(
                {"inputs": json.loads(rows([row]))["inputs"], "outputs": [{"name": "logits"}]}
            ).encode(),
            400,
            "logits",
        ),
    ]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, trained, headers):
    row = _row(trained)
    good = {"inputs": [{"name": "rows", "datatype": "BYTES", "shape": [1], "data": [row]}]}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        expected = client.post("/v2/models/ctr/infer", json=good, headers=headers).json()
        for description, body, status, words in _bad_requests(trained):
            response = client.post("/v2/models/ctr/infer", content=body, headers=headers)
            assert response.status_code == status, (description, response.text)
            error = response.json()["error"]
            assert words in error, (description, error)
        # unknown model and version, unknown route, wrong method: the same error shape
        for method, path, status in [
            ("POST", "/v2/models/other/infer", 404),
            ("GET", "/v2/models/other", 404),
            ("POST", "/v2/models/ctr/versions/99/infer", 404),
            ("GET", "/v2/nothing", 404),
            ("GET", "/v2/models/ctr/infer", 405),
        ]:
            response = client.request(method, path, json=good, headers=headers)
            assert response.status_code == status, (path, response.text)
            assert response.json()["error"]
        # an oversized body is refused before it is read whole
        huge = b'{"inputs": [' + b" " * (17 << 20) + b"]}"
        response = client.post("/v2/models/ctr/infer", content=huge, headers=headers)
        assert response.status_code == 413 and "limit" in response.json()["error"]
        # still serving, with the same answer
        again = client.post("/v2/models/ctr/infer", json=good, headers=headers)
        assert again.status_code == 200
        assert again.json()["outputs"] == expected["outputs"]


def test_missing_or_wrong_token_is_refused(server, trained, headers):
    row = _row(trained)
    good = {"inputs": [{"name": "rows", "datatype": "BYTES", "shape": [1], "data": [row]}]}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for sent in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "serving-test-token"},
        ):
            response = client.post("/v2/models/ctr/infer", json=good, headers=sent)
            assert response.status_code == 401
            assert "token" in response.json()["error"]
            assert client.get("/v2/models/ctr", headers=sent).status_code == 401
        assert client.get("/v2/health/live").status_code == 200  # probes need no token
        assert client.get("/v2/health/ready").status_code == 200
        assert client.post("/v2/models/ctr/infer", json=good, headers=headers).status_code == 200


def test_unseen_ids_get_the_default_row_and_are_counted(server, headers):
    ids = np.full((2, 26), 12345, np.uint64)  # no feature prefix: never produced by hashing
    body = {
        "inputs": [
            {"name": "ids", "datatype": "UINT64", "shape": [2, 26], "data": ids.ravel().tolist()},
            {"name": "dense", "datatype": "FP32", "shape": [2, 13], "data": [0.0] * 26},
        ]
    }
    with httpx.Client(base_url=server.url, timeout=30) as client:
        response = client.post("/v2/models/ctr/infer", json=body, headers=headers)
        assert response.status_code == 200, response.text
        assert response.json()["parameters"]["unseen_ids"] == 52
        probabilities = response.json()["outputs"][0]["data"]
        assert probabilities[0] == probabilities[1] and 0 < probabilities[0] < 1
        stats = client.get("/v2/models/ctr/stats", headers=headers).json()
        assert sum(stats["unseen_ids"].values()) >= 52


@pytest.mark.parametrize(
    "damage, named",
    [
        ("flip a byte of the tower", "model.stablehlo"),
        ("truncate a table", "values.npy"),
        ("remove the id index", "ids.npy"),
        ("remove the manifest", "manifest.json"),
        ("garble the manifest", "manifest.json"),
    ],
)
def test_corrupt_or_incomplete_export_refuses_to_load(exported, tmp_path, damage, named):
    copy = tmp_path / "export"
    shutil.copytree(exported / "1", copy)
    table = next((copy / "tables").iterdir())
    if damage == "flip a byte of the tower":
        data = bytearray((copy / "model.stablehlo").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (copy / "model.stablehlo").write_bytes(bytes(data))
    elif damage == "truncate a table":
        path = table / "values.npy"
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "remove the id index":
        (table / "ids.npy").unlink()
    elif damage == "remove the manifest":
        (copy / "manifest.json").unlink()
    else:
        (copy / "manifest.json").write_text('{"format": "hybridrec-export", ')
    with pytest.raises(ExportError, match=named.replace(".", r"\.")):
        ServedModel(copy)
    if damage != "flip a byte of the tower":  # without checksums, sizes and presence still count
        with pytest.raises(ExportError, match=named.replace(".", r"\.")):
            ServedModel(copy, checksums=False)


def test_serve_command_names_the_bad_file(exported, tmp_path):
    copy = tmp_path / "export"
    shutil.copytree(exported, copy)
    (copy / "1" / "features.json").write_text("{}")
    result = subprocess.run(
        [sys.executable, "-m", "hybridrec", "serve", str(copy), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "features.json" in result.stderr and "the manifest says" in result.stderr


def test_int64_ids_carry_the_same_bits_as_uint64(server, reference, headers):
    ids, dense = reference.ids[:16].copy(), reference.dense[:16]
    ids[0, 0] = 2**63 + 5  # an id past the int64 range: it travels as a negative INT64
    answers = []
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for datatype, values in (("UINT64", ids), ("INT64", ids.view(np.int64))):
            body = {
                "inputs": [
                    {"name": "ids", "datatype": datatype, "shape": list(ids.shape), "data": values.ravel().tolist()},
                    {"name": "dense", "datatype": "FP32", "shape": list(dense.shape), "data": dense.ravel().tolist()},
                ]
            }  # fmt: skip
            response = client.post("/v2/models/ctr/infer", json=body, headers=headers)
            assert response.status_code == 200, response.text
            answers.append(response.json()["outputs"][0]["data"])
    assert ids.view(np.int64)[0, 0] < 0
    assert answers[0] == answers[1]


@pytest.mark.parametrize(
    "arguments, words",
    [
        (["--step", "999999"], "no complete checkpoint at step 999999"),
        (["--name", "bad name"], "model name"),
    ],
)
def test_export_errors_leave_no_version(trained, tmp_path, arguments, words):
    out = tmp_path / "export"
    result = subprocess.run(
        [sys.executable, "-m", "hybridrec", "export", "--run", str(trained.run), "--out", str(out), *arguments],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists() or not any(out.iterdir())


def test_export_of_a_directory_that_is_not_a_run(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "hybridrec", "export", "--run", str(tmp_path), "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "not a run directory" in result.stderr
    assert f"hybridrec train --data DATA_DIR --run-dir {tmp_path}" in result.stderr


def test_serving_a_missing_export_names_the_command_that_makes_one(tmp_path):
    from hybridrec.serving._format import ExportError, resolve

    with pytest.raises(ExportError, match="does not exist.*hybridrec export --run RUN_DIR --out"):
        resolve(tmp_path / "missing")
    with pytest.raises(ExportError, match="no export in it.*hybridrec export --run RUN_DIR"):
        resolve(tmp_path)


def test_failed_export_leaves_nothing_visible(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained.run, run)
    out = tmp_path / "export"
    first = subprocess.run(
        [sys.executable, "-m", "hybridrec", "export", "--run", str(run), "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    # a damaged embedding checkpoint: the next export fails after it started writing
    shard = sorted((run / "checkpoints" / "embeddings").glob("step-*/*/shard-*"))[0]
    shutil.rmtree(shard / "values")
    second = subprocess.run(
        [sys.executable, "-m", "hybridrec", "export", "--run", str(run), "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert second.returncode == 2 and "values" in second.stderr
    assert sorted(path.name for path in out.iterdir()) == ["1"]  # no version 2, no leftovers
    ServedModel(out)  # version 1 is untouched


def test_a_stopped_server_says_what_it_served(exported, start_server, headers, tmp_path):
    """SIGTERM, as a process manager stops it: the last line counts the requests, the
    refused ones and the rows scored (uvicorn re-raises the signal after its shutdown)."""
    token_file = tmp_path / "token"
    token_file.write_text(headers["Authorization"].split()[1])
    server = start_server(str(exported), "--token-file", str(token_file))
    name = exported.name
    with httpx.Client(timeout=30) as client:
        good = client.get(f"{server.url}/v2/models/{name}", headers=headers)
        refused = client.get(f"{server.url}/v2/models/{name}")  # no token
    assert (good.status_code, refused.status_code) == (200, 401)
    server.stop()
    last = server.output.strip().splitlines()[-1]
    assert last.startswith("hybridrec serve: stopped after"), server.output
    assert "2 requests (1 refused), 0 rows scored by version 1" in last, last
