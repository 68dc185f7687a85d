"""2 processes x 4 CPU devices (gloo collectives) train exactly like 1 process x 8 devices."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("_multiprocess_worker.py")
REPO = Path(__file__).resolve().parents[2]
# Same programs, same per-device shards; only the cross-process all-reduce (gloo) differs
# from the in-process one in summation order.
RTOL, ATOL = 2e-5, 2e-6
PARAM_ATOL = 2e-5  # Adam amplifies rounding noise of ~0 gradients (see test_sharded_step.py)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _load_worker():
    spec = importlib.util.spec_from_file_location("_multiprocess_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.devices(8)
@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    coordinator = f"127.0.0.1:{_free_port()}"
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    outputs = [tmp_path / f"process{index}.npz" for index in range(2)]
    # process 0 gets its layout as arguments, process 1 from the environment
    commands = [
        [sys.executable, str(WORKER), coordinator, "2", "0", str(outputs[0])],
        [sys.executable, str(WORKER), str(outputs[1])],
    ]
    envs = [
        env,
        {
            **env,
            "HYBRIDREC_COORDINATOR": coordinator,
            "HYBRIDREC_NUM_PROCESSES": "2",
            "HYBRIDREC_PROCESS_ID": "1",
        },
    ]
    processes = [
        subprocess.Popen(
            command,
            env=process_env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for command, process_env in zip(commands, envs, strict=True)
    ]
    # The single-process run overlaps with the children (the machine has few cores).
    worker = _load_worker()
    expected = worker.run()
    logs = []
    for process in processes:
        try:
            logs.append(process.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise
    for process, log in zip(processes, logs, strict=True):
        assert process.returncode == 0, log[-3000:]

    per_process = [dict(np.load(path)) for path in outputs]
    rows = worker.GLOBAL_ROWS // 2
    for key, value in expected.items():
        if key.endswith("/losses") or "/params" in key:
            atol = PARAM_ATOL if "/params" in key else ATOL
            for result in per_process:  # every process sees the global value
                np.testing.assert_allclose(result[key], value, rtol=RTOL, atol=atol, err_msg=key)
        else:  # per-row outputs: each process holds its own rows, in its local order
            axis = 1 if key.endswith("/grads") else 0
            joined = np.concatenate([result[key] for result in per_process], axis=axis)
            np.testing.assert_allclose(joined, value, rtol=RTOL, atol=ATOL, err_msg=key)
            assert per_process[0][key].shape[axis] == rows
