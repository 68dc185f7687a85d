"""A tiny trained run, its export, a running `hybridrec serve`, and evaluate's per-row answers."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
ROWS = 12_000
TOKEN = "serving-test-token"

# the quickstart preset, shrunk so the run trains in seconds
SMALL_RUN = [
    "model.dlrm.bottom_mlp=[32, 8]",
    "model.dlrm.top_mlp=[64, 32]",
    "embedding.dim=8",
    "embedding.capacity=200000",
    "data.batch_size=256",
    "data.shuffle_buffer=4096",
    "log.every_steps=10",
    "checkpoint.every_steps=0",
    "eval.every_steps=0",
]


class Server:
    """A `hybridrec serve` subprocess on a free loopback port."""

    def __init__(self, *args: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hybridrec", "serve", *args, "--port", "0"],
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.process.stdout.readline()
        scheme = "https://" if "https://" in line else "http://"
        if scheme not in line:
            self.process.kill()
            pytest.fail(
                f"hybridrec serve did not start: {line}{self.process.stderr.read()[-3000:]}"
            )
        self.url = scheme + line.split(scheme, 1)[1].split()[0]

    def stop(self) -> str:
        """Stops the server (SIGTERM, as a process manager would); returns its stderr (its
        stdout after the start-up line is then `self.output`)."""
        self.process.terminate()
        try:
            self.output, stderr = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.output, stderr = self.process.communicate()
        return stderr


@pytest.fixture(scope="session")
def trained(tmp_path_factory, cli):
    """generate -> preprocess -> train (quickstart preset, small) through the CLI."""
    root = tmp_path_factory.mktemp("serving")
    raw = root / "raw.tsv"
    cli("generate", "--output", str(raw), "--rows", str(ROWS), "--seed", "11")
    data = root / "data"
    cli("preprocess", "--input", str(raw), "--output", str(data))
    run = root / "run"
    sets = [item for key in SMALL_RUN for item in ("--set", key)]
    cli("train", "--data", str(data), "--run-dir", str(run), "--config", "quickstart", *sets)
    return types.SimpleNamespace(root=root, raw=raw, data=data, run=run)


@pytest.fixture(scope="session")
def exported(trained, cli):
    """`hybridrec export` of the run at fp32: the export base directory."""
    out = trained.root / "export" / "ctr"
    cli("export", "--run", str(trained.run), "--out", str(out), "--precision", "fp32")
    return out


@pytest.fixture(scope="session")
def server(exported, trained):
    """`hybridrec serve` of the fp32 export, with a token."""
    token_file = trained.root / "token"
    token_file.write_text(TOKEN + "\n")
    server = Server(str(exported), "--token-file", str(token_file), "--max-rows", "512")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def reference(trained):
    from hybridrec.serving.reference import evaluate_rows

    ids, dense, labels, probabilities = evaluate_rows(trained.run, trained.data)
    return types.SimpleNamespace(ids=ids, dense=dense, labels=labels, probabilities=probabilities)


@pytest.fixture(scope="session")
def headers():
    """What an authorized client sends."""
    return {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="session")
def start_server():
    """`start_server(*args)`: a `hybridrec serve` subprocess (stop it with `.stop()`)."""
    return Server
