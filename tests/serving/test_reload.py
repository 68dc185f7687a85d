"""`serve --watch` swaps in a newer export version under load without failing a request."""

from __future__ import annotations

import shutil
import threading
import time

import httpx


def test_watch_swaps_versions_under_load(trained, exported, tmp_path, cli, start_server):
    base = tmp_path / "watched"
    base.mkdir()
    shutil.copytree(exported / "1", base / "1")
    server = start_server(str(base), "--watch", "--max-delay-ms", "1")
    rows = [line for line in trained.raw.read_text().split("\n") if line][:64]
    body = {"inputs": [{"name": "rows", "datatype": "BYTES", "shape": [len(rows)], "data": rows}]}
    results: list[tuple[int, str | None]] = []
    stop = threading.Event()
    deadline = time.monotonic() + 120  # bounded even if the swap never happens

    def client_loop():
        with httpx.Client(base_url=server.url, timeout=30) as client:
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    response = client.post("/v2/models/ctr/infer", json=body)
                    version = response.json().get("model_version")
                    results.append((response.status_code, version))
                except httpx.HTTPError as error:
                    results.append((0, repr(error)))

    threads = [threading.Thread(target=client_loop) for _ in range(4)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        # a newer version appears while requests are in flight (int8: its answers differ)
        cli(
            "export",
            "--run",
            str(trained.run),
            "--out",
            str(base),
            "--precision",
            "int8",
            "--name",
            "ctr",
        )
        while time.monotonic() < deadline and not any(v == "2" for _, v in results[-20:]):
            time.sleep(0.1)
        time.sleep(1.5)  # keep the load on while the old version is closed
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        stderr = server.stop()
    statuses = [status for status, _ in results]
    versions = [version for _, version in results]
    assert len(results) > 50
    assert statuses.count(200) == len(statuses), [r for r in results if r[0] != 200][:3]
    assert "1" in versions and "2" in versions
    first_new = versions.index("2")
    # once the new version answered, the old one answers only requests already queued
    assert versions[first_new + 20 :].count("1") == 0
    assert "now serving version 2" in stderr
