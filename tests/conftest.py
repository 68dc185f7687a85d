"""Every test sees an 8-device CPU mesh; set before anything imports JAX.

HYBRIDREC_TEST_HOST_DEVICES=1 gives the CPU one device instead, as a single GPU has
(JAX_PLATFORMS=cuda on a GPU host runs the suite on the GPU).
"""

import os
import socket

HOST_DEVICES = int(os.environ.get("HYBRIDREC_TEST_HOST_DEVICES", "8"))
os.environ["XLA_FLAGS"] = " ".join(
    flag
    for flag in (
        os.environ.get("XLA_FLAGS", ""),
        f"--xla_force_host_platform_device_count={HOST_DEVICES}",
    )
    if flag
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# On a GPU the test process and the commands it starts (trainers, servers) share the
# device: each allocates what it uses instead of most of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# A GPU's float32 matmuls are TF32 by default (10-bit mantissas): results that the tests
# compare across batch shapes or with float64 differ there by ~1e-3. The tests check
# float32 semantics, so every matmul is full float32 (a no-op on a CPU).
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# The commands' compilation cache lives in one fresh directory per test session: nothing
# written to the home directory, and no entry from an earlier session is reused.
# The process that made it (pytest's, whose workers inherit the variable) removes it.
if "HYBRIDREC_COMPILATION_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["HYBRIDREC_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="hybridrec-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["HYBRIDREC_COMPILATION_CACHE"], True)

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
CRITEO_SAMPLE = REPO_ROOT.parent / "shared" / "data" / "criteo_kaggle_sample" / "train.tsv.gz"


def pytest_runtest_setup(item):
    """`@pytest.mark.devices(n)`: the test needs n devices (a mesh of that shape, devices
    in several processes); on a platform with fewer (one GPU, or
    HYBRIDREC_TEST_HOST_DEVICES=1) it says so and skips. With `launched=True` the devices
    are those of processes `hybridrec launch` starts: CPU devices it makes for each, so
    only a GPU platform needs n of them."""
    marker = item.get_closest_marker("devices")
    if marker is None:
        return
    import jax

    if marker.kwargs.get("launched") and jax.default_backend() == "cpu":
        return
    needed, have = marker.args[0], jax.device_count()
    if have < needed:
        pytest.skip(f"needs {needed} devices; this {jax.default_backend()} platform has {have}")


@pytest.fixture(scope="session")
def criteo_sample() -> Path:
    """The real Criteo sample next to the repo; tests using it skip when it is absent."""
    if not CRITEO_SAMPLE.exists():
        pytest.skip(f"real Criteo sample not present at {CRITEO_SAMPLE}")
    return CRITEO_SAMPLE


def hybridrec(
    *args: str, env: dict | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Runs the real `hybridrec` command line in a subprocess; fails the test on error."""
    result = subprocess.run(
        [sys.executable, "-m", "hybridrec", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        pytest.fail(
            f"hybridrec {' '.join(args)} exited {result.returncode}\n"
            f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"
        )
    return result


@pytest.fixture(scope="session")
def cli():
    """The `hybridrec(*args, env=None, timeout=300)` subprocess runner."""
    return hybridrec


@pytest.fixture(scope="session")
def tls_certs(tmp_path_factory):
    """A throwaway PKI (scripts/make_certs.py), PEM files in one directory; attributes name
    (cert, key) pairs, `ca` and `other_ca` name CA certificates:

        server          localhost and 127.0.0.1, signed by the CA
        client          a client certificate signed by the CA (mutual TLS)
        expired         like server, but it expired ten days ago
        expired_client  like client, expired
        wrong_host      for elsewhere.example and 10.1.2.3 only
        node            this machine's host name, localhost and 127.0.0.1 (servers that
                        announce the host name, as the Slurm job's do)
        other_client    a client certificate signed by another CA
    """
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location(
        "make_certs", REPO_ROOT / "scripts" / "make_certs.py"
    )
    make_certs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_certs)
    out = tmp_path_factory.mktemp("tls")
    ca, other_ca = make_certs.new_ca(), make_certs.new_ca("another test CA")
    local = ["localhost", "127.0.0.1"]
    issued = {
        "server": make_certs.issue(ca, "localhost", hosts=local),
        "client": make_certs.issue(ca, "trainer", client=True),
        "expired": make_certs.issue(ca, "localhost", hosts=local, expired=True),
        "expired_client": make_certs.issue(ca, "trainer", client=True, expired=True),
        "wrong_host": make_certs.issue(ca, "elsewhere", hosts=["elsewhere.example", "10.1.2.3"]),
        "node": make_certs.issue(ca, socket.gethostname(), hosts=[socket.gethostname(), *local]),
        "other_client": make_certs.issue(other_ca, "trainer", client=True),
    }
    files = {name: tuple(map(str, pair.write(out, name))) for name, pair in issued.items()}
    files["ca"] = str(ca.write(out, "ca")[0])
    files["other_ca"] = str(other_ca.write(out, "other_ca")[0])
    return types.SimpleNamespace(dir=out, **files)
