"""Start a server on a free loopback port, send it one request over HTTP, stop it:
`demo_score` (a click-log run's rows) and `demo_top_k` (a sequence run's histories)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridrec.common.errors import UserError
from hybridrec.serving.server import ServeOptions, bind, make_server


@contextlib.contextmanager
def _running(export_dir: str | Path, timeout: float):
    """A `serve` of the export in this process on 127.0.0.1: yields post(body) -> answer."""
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
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v2/models/{model.name}/infer"

        def post(body: dict[str, Any]) -> dict[str, Any]:
            request = urllib.request.Request(
                url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as error:
                raise UserError(
                    f"the server refused the request: {error.read().decode()}"
                ) from None

        yield post
    finally:
        server.should_exit = True
        thread.join(timeout)


def demo_score(
    export_dir: str | Path, rows: Sequence[str | bytes], *, timeout: float = 60.0
) -> list[float]:
    """Click probabilities of raw `rows` as a client of a real `serve` process sees them.

    Args:
        export_dir: an export directory of a click-log run (its newest version is served).
        rows: raw lines in the dataset's layout (label column optional).
        timeout: seconds to wait for the server to start and answer.

    Returns:
        One probability per row.
    """
    lines = [row.decode() if isinstance(row, bytes) else row for row in rows]
    body = {"inputs": [{"name": "rows", "datatype": "BYTES", "shape": [len(lines)], "data": lines}]}
    with _running(export_dir, timeout) as post:
        answer = post(body)
    return [float(value) for value in answer["outputs"][0]["data"]]


def demo_top_k(
    export_dir: str | Path,
    histories: Sequence[Sequence[str]],
    *,
    k: int = 5,
    times: Sequence[Sequence[int]] | None = None,
    actions: Sequence[Sequence[str]] | None = None,
    sides: dict[str, Sequence[Sequence[str]]] | None = None,
    timeout: float = 60.0,
) -> list[list[tuple[str, float]]]:
    """Each history's top-`k` next items, as a client of a real `serve` process sees them.

    Args:
        export_dir: an export directory of a sequence run.
        histories: per user, raw item ids, oldest first.
        times, actions: per user, each event's time (seconds) and action type name, sent
            with the items (a model that reads them needs them; others ignore them).
        sides: per event side feature the model reads, per user each event's raw value.

    Returns:
        Per user, (raw item id, score) best first.
    """
    flat = [item for history in histories for item in history]
    body = {
        "inputs": [
            {"name": "history", "datatype": "BYTES", "shape": [len(flat)], "data": flat},
            {
                "name": "lengths",
                "datatype": "INT64",
                "shape": [len(histories)],
                "data": [len(history) for history in histories],
            },
        ],
        "parameters": {"k": k},
    }
    given = [("times", "INT64", times), ("actions", "BYTES", actions)]
    given += [(name, "BYTES", values) for name, values in (sides or {}).items()]
    for name, datatype, values in given:
        if values is not None:
            flat_values = [value for per_user in values for value in per_user]
            body["inputs"].append({"name": name, "datatype": datatype, "shape": [len(flat_values)], "data": flat_values})  # fmt: skip
    with _running(export_dir, timeout) as post:
        answer = post(body)
    items, scores = (output["data"] for output in answer["outputs"])
    return [
        list(zip(items[row * k : (row + 1) * k], scores[row * k : (row + 1) * k], strict=True))
        for row in range(len(histories))
    ]
