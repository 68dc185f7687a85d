"""`demo_score`: start a server on a free loopback port, score rows over HTTP, stop it."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from hybridrec.common.errors import UserError
from hybridrec.serving.server import ServeOptions, bind, make_server


def demo_score(
    export_dir: str | Path, rows: Sequence[str | bytes], *, timeout: float = 60.0
) -> list[float]:
    """Click probabilities of raw `rows` as a client of a real `serve` process sees them.

    Starts the server in this process on 127.0.0.1 (a free port), sends one Open
    Inference Protocol request with the rows as a BYTES tensor, and stops the server.

    Args:
        export_dir: an export directory (its newest version is served).
        rows: raw lines in the dataset's layout (label column optional).
        timeout: seconds to wait for the server to start and answer.

    Returns:
        One probability per row.
    """
    sock = bind("127.0.0.1", 0)
    server, model = make_server(export_dir, sock, ServeOptions())
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise UserError(f"the server for {export_dir} did not start")
            time.sleep(0.01)
        port = sock.getsockname()[1]
        lines = [row.decode() if isinstance(row, bytes) else row for row in rows]
        body = {
            "inputs": [{"name": "rows", "datatype": "BYTES", "shape": [len(lines)], "data": lines}]
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v2/models/{model.name}/infer",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as error:
            raise UserError(f"the server refused the rows: {error.read().decode()}") from None
        return [float(value) for value in answer["outputs"][0]["data"]]
    finally:
        server.should_exit = True
        thread.join(timeout)
