"""`hybridrec serve` runs without the training code: a click-log export and a sequence
export, each served by the command in a fresh process, load no module of
hybridrec.training or hybridrec.model, nor Flax, Optax or Orbax (what a serving image
need not carry); scripts/check_layers.py checks the same statically, transitively."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from hybridrec.pipeline.events.synthetic_events import EventLogConfig

from tests.training.test_sequence_training import SMALL, events_dataset

# run in a fresh process: the serve command in the main thread, a watcher thread that
# waits for the server to be ready, prints what is loaded, then stops it as SIGTERM would
PROBE = """
import json, os, signal, sys, threading, time, urllib.request

export, port = sys.argv[1], int(sys.argv[2])
started = time.monotonic()

def watch():
    for _ in range(1200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1)
            break
        except OSError:
            time.sleep(0.05)
    import resource
    loaded = sorted(
        name for name in sys.modules
        if name.split(".")[0] in ("flax", "optax", "orbax")
        or name.startswith(("hybridrec.training", "hybridrec.model"))
    )
    print("PROBE " + json.dumps({
        "loaded": loaded,
        "ready_s": time.monotonic() - started,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=watch, daemon=True).start()
from hybridrec import cli
sys.exit(cli.main(["serve", export, "--port", str(port)]))
"""


def probe(export) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(export), str(port)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, f"the server did not come up:\n{result.stdout}\n{result.stderr[-3000:]}"
    return json.loads(lines[0].removeprefix("PROBE "))


@pytest.fixture(scope="module")
def sequence_export(tmp_path_factory):
    import hybridrec

    root = tmp_path_factory.mktemp("runtime_imports")
    data = events_dataset(root, EventLogConfig(users=300, items=120, topics=4, mean_events=10, seed=2))  # fmt: skip
    config = hybridrec.load_config("sasrec", [*SMALL, "data.max_steps=4"])
    hybridrec.train(config, data=data, run_dir=root / "run", quiet=True)
    hybridrec.export(root / "run", root / "export", quiet=True)
    return root / "export"


def test_a_click_log_export_serves_without_the_training_code(exported):
    assert probe(exported)["loaded"] == []


def test_a_sequence_export_serves_without_the_training_code(sequence_export):
    assert probe(sequence_export)["loaded"] == []
