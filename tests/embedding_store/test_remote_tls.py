"""Remote shards over TLS (grpc+tls://), with servers in this process on loopback.

The same rows as plaintext, mutual TLS, the token only inside TLS, and every refusal as
one line that names the problem, raised at once instead of after the retry timeout.
Certificates come from the throwaway PKI of the `tls_certs` fixture (tests/conftest.py).
"""

import json
import re
import socket
import threading
import time

import numpy as np
import pytest
from hybridrec.common.errors import UserError
from hybridrec.common.tls import TLSConfig, TLSFiles
from hybridrec.embedding_store import (
    EmbeddingStore,
    SparseOptimizerConfig,
    TableConfig,
)
from hybridrec.embedding_store.remote.client import RemoteShardError, connect
from hybridrec.embedding_store.remote.shard_server import ShardServer

from hybridrec.cli.serve_embeddings import main as serve_embeddings

from .remote_calls import addresses, same_calls

TABLES = [
    TableConfig(name="ads", dim=4, capacity=2000),
    TableConfig(
        name="users",
        dim=8,
        capacity=2000,
        optimizer=SparseOptimizerConfig(name="adam", learning_rate=0.05),
    ),
]
TOKEN = "tls-test-token"
RETRY_TIMEOUT = 30.0  # a refusal must come long before this


def _server_tls(certs, name="server", *, ca=None):
    cert, key = getattr(certs, name)
    return TLSFiles(cert=cert, key=key, ca=ca or "")


def _client_tls(certs, *, ca=None, client=None):
    """The trainer's view: TLSFiles named after the embedding.tls.* config keys."""
    cert, key = getattr(certs, client) if client else ("", "")
    config = TLSConfig(ca=certs.ca if ca is None else ca, cert=cert, key=key)
    return TLSFiles.from_config(config, "embedding.tls")


def test_tls_and_mutual_tls_give_the_rows_of_plaintext(start_servers, tls_certs):
    plain = start_servers([[0], [1]], num_shards=2, token=TOKEN)
    tls = start_servers([[0], [1]], num_shards=2, token=TOKEN, tls=_server_tls(tls_certs))
    mutual = start_servers(
        [[0, 1]], num_shards=2, token=TOKEN, tls=_server_tls(tls_certs, ca=tls_certs.ca)
    )
    assert all(server.tls for server in tls + mutual) and not plain[0].tls
    assert mutual[0].client_certificates_required and not tls[0].client_certificates_required
    stores = [
        EmbeddingStore(TABLES, num_shards=2),
        EmbeddingStore(TABLES, shards=connect(addresses(plain), TABLES, token=TOKEN)),
        EmbeddingStore(
            TABLES,
            shards=connect(addresses(tls), TABLES, token=TOKEN, tls=_client_tls(tls_certs)),
        ),
        EmbeddingStore(
            TABLES,
            shards=connect(
                addresses(mutual), TABLES, token=TOKEN, tls=_client_tls(tls_certs, client="client")
            ),
        ),
    ]
    assert [shard.address for shard in stores[2]._shards] == [
        f"grpc+tls://127.0.0.1:{server.port}" for server in tls
    ]
    same_calls(stores, np.random.default_rng(0), range(4))
    universe = np.arange(300, dtype=np.uint64)
    everything = [store.lookup("users", universe, train=False).result() for store in stores]
    for rows in everything[1:]:
        np.testing.assert_array_equal(rows, everything[0])
    assert stores[2].stats() == stores[0].stats()
    # "localhost" is on the server certificate too
    (shard, _) = connect(
        [f"localhost:{tls[0].port}", f"grpc+tls://localhost:{tls[1].port}"],
        TABLES,
        token=TOKEN,
        tls=_client_tls(tls_certs),
    )
    assert shard.stats() == stores[2]._shards[0].stats()
    for store in stores:
        store.close()

    # the token is still checked inside TLS
    with pytest.raises(RemoteShardError, match="refused the token"):
        connect(addresses(tls), TABLES, token="wrong", tls=_client_tls(tls_certs))


def _refusal(addresses, tls, token=None):
    """The one-line error of connecting, and how long it took."""
    start = time.monotonic()
    with pytest.raises(RemoteShardError) as caught:
        connect(addresses, TABLES, token=token, tls=tls, retry_timeout=RETRY_TIMEOUT)
    message = str(caught.value)
    assert "\n" not in message, message
    return message, time.monotonic() - start


@pytest.mark.parametrize(
    "server, client, expected",
    [
        ("server", "wrong CA", r"its certificate is not signed by the CA in embedding.tls.ca "),
        ("server", "plaintext", r"it speaks TLS and this client connects in plaintext"),
        ("plaintext", "tls", r"it does not speak TLS \(start it with --tls-cert and --tls-key\)"),
        ("expired", "tls", r"its certificate has expired"),
        ("wrong_host", "tls", r"its certificate is not valid for the host name 127\.0\.0\.1"),
        ("mutual", "tls", r"requires a client certificate .*embedding.tls.cert and embedding"),
        ("mutual", "other_client", r"refused this client's certificate embedding.tls.cert "),
        ("mutual", "expired_client", r"refused this client's certificate .*: it expired on "),
    ],
)
def test_refusals_are_one_line_and_immediate(start_servers, tls_certs, server, client, expected):
    if server == "plaintext":
        server_tls = None
    elif server == "mutual":
        server_tls = _server_tls(tls_certs, ca=tls_certs.ca)
    else:
        server_tls = _server_tls(tls_certs, server)
    client_tls = {
        "plaintext": None,
        "tls": _client_tls(tls_certs),
        "wrong CA": _client_tls(tls_certs, ca=tls_certs.other_ca),
        "other_client": _client_tls(tls_certs, client="other_client"),
        "expired_client": _client_tls(tls_certs, client="expired_client"),
    }[client]
    servers = start_servers([[0]], num_shards=1, token=TOKEN, tls=server_tls)
    message, seconds = _refusal(addresses(servers), client_tls, token=TOKEN)
    assert message.startswith(f"embedding server grpc{'+tls' if client_tls else ''}://127.0.0.1:")
    assert re.search(expected, message), message
    assert seconds < 10, f"refused after {seconds:.1f} s: {message}"
    assert servers[0].stats()["counters"] == {}  # nothing reached the shards


def test_a_tls_client_never_sends_its_token_in_plaintext(tls_certs):
    """A listener that records every byte it gets: the TLS client's hello, never the token."""
    listener = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def record():
        listener.settimeout(20)
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            with connection:
                connection.settimeout(2)
                # answer like a plaintext gRPC server: an HTTP/2 SETTINGS frame
                connection.sendall(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
                try:
                    while chunk := connection.recv(65536):
                        received.extend(chunk)
                except OSError:
                    pass

    thread = threading.Thread(target=record, daemon=True)
    thread.start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        message, _ = _refusal([address], _client_tls(tls_certs), token=TOKEN)
    finally:
        listener.close()
        thread.join(10)
    assert "does not speak TLS" in message and "sends nothing in plaintext" in message
    assert received and TOKEN.encode() not in bytes(received)
    assert b"authorization" not in bytes(received).lower()

    # nor to an address that names a plaintext transport: refused before dialling
    with pytest.raises(UserError, match=r"grpc\+tcp://127.0.0.1:1 is not a TLS address.*token"):
        connect(["grpc+tcp://127.0.0.1:1"], TABLES, token=TOKEN, tls=_client_tls(tls_certs))


def test_missing_or_wrong_files_name_the_file_and_the_flag_or_key(tls_certs, tmp_path):
    missing = str(tmp_path / "nowhere.pem")
    cert, key = tls_certs.server
    client_cert, client_key = tls_certs.client
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases = [
        # the trainer: embedding.tls.* keys
        (TLSConfig(ca=missing), rf"^embedding.tls.ca {missing}: no such file$"),
        (
            TLSConfig(ca=tls_certs.ca, cert=client_cert, key=missing),
            rf"^embedding.tls.key {missing}: no such file$",
        ),
        (TLSConfig(ca=str(garbage)), "embedding.tls.ca .*garbage.pem: no PEM certificate in it"),
        (
            TLSConfig(cert=client_cert),
            "embedding.tls.cert .* given without embedding.tls.key",
        ),
        (
            TLSConfig(cert=client_cert, key=key),
            "embedding.tls.key .*: not the private key of embedding.tls.cert ",
        ),
    ]
    for config, expected in cases:
        with pytest.raises(UserError, match=expected):
            connect(["127.0.0.1:1"], TABLES, tls=TLSFiles.from_config(config, "embedding.tls"))
    # the servers: --tls-* flags
    server_cases = [
        (TLSFiles(cert=missing, key=key), rf"^--tls-cert {missing}: no such file$"),
        (TLSFiles(cert=cert, key=missing), rf"^--tls-key {missing}: no such file$"),
        (TLSFiles(cert=cert, key=key, ca=missing), rf"^--tls-ca {missing}: no such file$"),
        (TLSFiles(cert=cert), "--tls-cert given without --tls-key"),
        (TLSFiles(ca=tls_certs.ca), "--tls-ca given without --tls-cert"),
        (TLSFiles(cert=str(garbage), key=key), "--tls-cert .*garbage.pem: no PEM certificate"),
        (TLSFiles(cert=cert, key=str(garbage)), "--tls-key .*: not an unencrypted PEM private"),
    ]
    for tls, expected in server_cases:
        with pytest.raises(UserError, match=expected):
            ShardServer(TABLES, [0], num_shards=1, tls=tls)


def test_command_line_tls(tls_certs, tmp_path, capsys):
    tables = tmp_path / "tables.toml"
    tables.write_text('[[tables]]\nname = "ads"\ndim = 4\ncapacity = 100\n')
    missing = str(tmp_path / "server.key")
    cert, key = tls_certs.server
    with pytest.raises(UserError, match=rf"^--tls-key {missing}: no such file$"):
        serve_embeddings(
            ["--tables", str(tables), "--num-shards", "1", "--tls-cert", cert, "--tls-key", missing]
        )
    # --check and --stats take the same flags as a client: CA to verify, certificate to present
    server = ShardServer(TABLES, [0], num_shards=1, tls=_server_tls(tls_certs, ca=tls_certs.ca))
    try:
        address = f"127.0.0.1:{server.port}"
        client_cert, client_key = tls_certs.client
        flags = ["--tls-ca", tls_certs.ca, "--tls-cert", client_cert, "--tls-key", client_key]
        assert serve_embeddings(["--check", address, *flags]) == 0
        assert json.loads(capsys.readouterr().out)["ready"] is True
        assert serve_embeddings(["--check", address, "--tls-ca", tls_certs.ca]) == 1
        error = capsys.readouterr().err.strip()
        assert error.count("\n") == 0 and "requires a client certificate" in error
        assert "--tls-cert and --tls-key" in error
        assert serve_embeddings(["--check", address]) == 1
        assert "speaks TLS and this client connects in plaintext" in capsys.readouterr().err
    finally:
        server.drain_and_stop(timeout=5)
