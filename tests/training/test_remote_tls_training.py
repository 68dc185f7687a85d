"""`hybridrec train` against shard servers that require TLS and client certificates.

`hybridrec launch --embedding-servers 1 --tls-*` starts the server, the train command's
`embedding.tls.*` keys verify it and present the client certificate, and the token from
$HYBRIDREC_EMBEDDING_TOKEN travels inside TLS. A trainer without the keys is refused in
one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hybridrec.common.tls import TLSFiles
from hybridrec.embedding_store import TableConfig
from hybridrec.embedding_store.remote.shard_server import ShardServer

TOKEN = "tls-training-token"


def test_training_over_mutual_tls_and_the_refusal_without_it(
    dataset, tmp_path, cli, small_model, training, tls_certs
):
    keys = small_model("data.max_steps=10")
    cert, key = tls_certs.server
    client_cert, client_key = tls_certs.client
    tls_keys = [
        f"embedding.tls.ca={json.dumps(tls_certs.ca)}",
        f"embedding.tls.cert={json.dumps(client_cert)}",
        f"embedding.tls.key={json.dumps(client_key)}",
    ]
    run_dir = tmp_path / "run"
    logs = tmp_path / "server-logs"
    cli(
        "launch", "-n", "1", "--embedding-servers", "1", "--server-logs", str(logs),
        "--tls-cert", cert, "--tls-key", key, "--tls-ca", tls_certs.ca,
        "--", *training.args(dataset, run_dir, "--quiet", *keys),
        *(item for setting in tls_keys for item in ("--set", setting)),
        env={"HYBRIDREC_EMBEDDING_TOKEN": TOKEN},
        timeout=400,
    )  # fmt: skip
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 10
    log = (logs / "embedding-server-0.log").read_text()
    assert "token required; TLS, client certificates required" in log
    saved = json.loads((run_dir / "config.json").read_text())["embedding"]["tls"]
    assert saved == {"ca": tls_certs.ca, "cert": client_cert, "key": client_key}

    # a server like those, and a trainer that was not told about TLS: one line, no
    # traceback (refused in the handshake, before the tables are compared)
    server = ShardServer(
        [TableConfig(name="embeddings", dim=8, capacity=1000)],
        [0, 1],
        num_shards=2,
        token=TOKEN,
        tls=TLSFiles(cert=cert, key=key, ca=tls_certs.ca),
    )
    try:
        command = training.args(dataset, tmp_path / "refused", *keys)
        command += ["--set", f"embedding.servers={json.dumps([f'127.0.0.1:{server.port}'])}"]
        error = _refused(command)
        assert "speaks TLS and this client connects in plaintext" in error
        assert "embedding.tls.ca" in error
        # with the CA but no client certificate
        command += ["--set", tls_keys[0]]
        error = _refused(command)
        assert "requires a client certificate" in error
        assert "embedding.tls.cert and embedding.tls.key" in error
    finally:
        server.drain_and_stop(timeout=5)


def _refused(command: list[str]) -> str:
    """Runs `hybridrec *command`, which must be refused with one line; returns that line."""
    refused = subprocess.run(
        [sys.executable, "-m", "hybridrec", *command],
        env={**os.environ, "HYBRIDREC_EMBEDDING_TOKEN": TOKEN},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 2
    error = refused.stderr.strip()
    assert error.count("\n") == 0, error
    return error
