"""`hybridrec serve` over HTTPS (--tls-cert/--tls-key) and with client certificates
(--tls-ca), through httpx and tritonclient; what clients that do not fit are told."""

from __future__ import annotations

import ssl
import subprocess
import sys

import httpx
import numpy as np
import pytest
import tritonclient.http as triton

from .kserve import id_and_dense_inputs

ROWS = 64


def _context(ca: str, client: tuple[str, str] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca)
    if client:
        context.load_cert_chain(*client)
    return context


def _inputs(reference) -> list[dict]:
    return id_and_dense_inputs(reference.ids[:ROWS], reference.dense[:ROWS])


def _scores(client: httpx.Client, url: str, reference, headers=None) -> np.ndarray:
    response = client.post(
        f"{url}/v2/models/ctr/infer", json={"inputs": _inputs(reference)}, headers=headers
    )
    assert response.status_code == 200, response.text
    return np.asarray(response.json()["outputs"][0]["data"], np.float32)


@pytest.fixture
def serving(start_server):
    """start(*args) -> a `hybridrec serve` subprocess; every one is stopped at teardown."""
    started = []

    def start(*args):
        started.append(start_server(*args))
        return started[-1]

    yield start
    for process in started:
        process.stop()


def test_https_with_token_gives_the_plaintext_answers(
    exported, trained, server, headers, reference, tls_certs, serving
):
    cert, key = tls_certs.server
    token_file = trained.root / "token"  # written by the `server` fixture
    https = serving(str(exported), "--token-file", str(token_file), "--tls-cert", cert, "--tls-key", key)  # fmt: skip
    assert https.url.startswith("https://127.0.0.1:")
    with httpx.Client(timeout=60) as plain:
        expected = _scores(plain, server.url, reference, headers)
    with httpx.Client(timeout=60, verify=_context(tls_certs.ca)) as client:
        np.testing.assert_array_equal(_scores(client, https.url, reference, headers), expected)
        assert client.get(f"{https.url}/v2/health/ready").status_code == 200
        # the token is still required, now inside TLS
        response = client.post(
            f"{https.url}/v2/models/ctr/infer", json={"inputs": _inputs(reference)}
        )
        assert response.status_code == 401
        assert client.get(f"{https.url.replace('127.0.0.1', 'localhost')}/v2").status_code == 401

    triton_client = triton.InferenceServerClient(
        https.url.removeprefix("https://"), ssl=True, ssl_options={"ca_certs": tls_certs.ca}
    )
    assert triton_client.is_server_ready()
    ids = triton.InferInput("ids", list(reference.ids[:ROWS].shape), "UINT64")
    ids.set_data_from_numpy(reference.ids[:ROWS])
    dense = triton.InferInput("dense", list(reference.dense[:ROWS].shape), "FP32")
    dense.set_data_from_numpy(reference.dense[:ROWS])
    result = triton_client.infer("ctr", [ids, dense], headers=dict(headers))
    np.testing.assert_array_equal(result.as_numpy("probabilities"), expected)
    triton_client.close()

    # clients that do not fit are refused by their TLS layer
    with (
        httpx.Client(timeout=10, verify=_context(tls_certs.other_ca)) as wrong_ca,
        pytest.raises(httpx.ConnectError, match="unable to get local issuer certificate"),
    ):
        wrong_ca.get(f"{https.url}/v2/health/ready")
    with (
        httpx.Client(timeout=10) as plaintext,
        pytest.raises(httpx.TransportError),
    ):
        plaintext.get(https.url.replace("https://", "http://") + "/v2/health/ready")


def test_mutual_tls_requires_a_client_certificate_signed_by_the_ca(
    exported, reference, tls_certs, serving
):
    cert, key = tls_certs.server
    mutual = serving(str(exported), "--tls-cert", cert, "--tls-key", key, "--tls-ca", tls_certs.ca)
    url = f"{mutual.url}/v2/health/ready"
    with httpx.Client(timeout=60, verify=_context(tls_certs.ca, tls_certs.client)) as client:
        assert client.get(url).status_code == 200
        assert len(_scores(client, mutual.url, reference)) == ROWS
    for client_pair in (None, tls_certs.other_client, tls_certs.expired_client):
        with (
            httpx.Client(timeout=10, verify=_context(tls_certs.ca, client_pair)) as client,
            pytest.raises(httpx.TransportError),
        ):
            client.get(url)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("expired", "certificate has expired"),
        ("wrong_host", "IP address mismatch, certificate is not valid for '127.0.0.1'"),
    ],
)
def test_clients_refuse_an_expired_or_misnamed_server_certificate(
    exported, tls_certs, serving, name, expected
):
    cert, key = getattr(tls_certs, name)
    served = serving(str(exported), "--tls-cert", cert, "--tls-key", key)
    with (
        httpx.Client(timeout=10, verify=_context(tls_certs.ca)) as client,
        pytest.raises(httpx.ConnectError, match=expected),
    ):
        client.get(f"{served.url}/v2/health/ready")


def test_missing_certificate_or_key_is_one_line_naming_the_file_and_flag(
    exported, tls_certs, tmp_path
):
    cert, key = tls_certs.server
    missing = tmp_path / "server.key"
    cases = [
        (["--tls-cert", cert, "--tls-key", str(missing)], f"--tls-key {missing}: no such file"),
        (["--tls-cert", str(missing), "--tls-key", key], f"--tls-cert {missing}: no such file"),
        (["--tls-cert", cert], "--tls-cert given without --tls-key"),
        (
            ["--tls-cert", cert, "--tls-key", key, "--tls-ca", str(missing)],
            f"--tls-ca {missing}: no such file",
        ),
    ]
    for flags, expected in cases:
        result = subprocess.run(
            [sys.executable, "-m", "hybridrec", "serve", str(exported), "--port", "0", *flags],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2
        assert result.stderr.startswith(f"hybridrec serve: error: {expected}"), result.stderr
        assert result.stderr.count("\n") == 1, result.stderr
