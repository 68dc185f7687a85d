"""The job on Dask (2 worker processes) writes exactly what the DirectRunner writes.

Same rows and ids in the same files, same split membership, statistics and rejected-row
report; a killed worker is retried or fails the job cleanly; an unreachable scheduler is
a one-line error.
"""

import gzip
import json
import os
import signal
import threading
import time

import pyarrow.parquet as pq
import pytest

from hybridrec import cli

from .reference import GOOD_ROW, row

distributed = pytest.importorskip("distributed")
dask = pytest.importorskip("dask")

DIRECT = ["--runner", "direct", "--direct_running_mode=in_memory", "--quiet"]


def preprocess(*args):
    return cli.main(["preprocess", *map(str, args)])


def assert_same_output(direct, dask):
    """Every file and every metadata field but the runner line is the same."""
    first, second = (json.loads((out / "metadata.json").read_text()) for out in (direct, dask))
    assert first.pop("runner").startswith("DirectRunner")
    assert second.pop("runner").startswith("DaskRunner")
    assert first == second
    assert first["splits"]["train"]["files"] and first["splits"]["eval"]["files"]
    for split in ("train", "eval"):
        for name in first["splits"][split]["files"]:
            assert pq.read_table(direct / name).equals(pq.read_table(dask / name)), name
    for name in first["rejected_files"]:
        assert (direct / name).read_bytes() == (dask / name).read_bytes(), name
    listing = [sorted(str(p.relative_to(out)) for p in out.rglob("*")) for out in (direct, dask)]
    assert listing[0] == listing[1]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """One TSV cut into several chunks, with bad lines, and a small .gz file."""
    root = tmp_path_factory.mktemp("dask_inputs")
    assert (
        cli.main(["generate", "-o", str(root / "day_0.tsv"), "--rows", "24000", "--seed", "4"]) == 0
    )
    with open(root / "day_0.tsv", "a") as handle:
        handle.write(row(fields=12) + "\n" + row(label="2") + "\n")
    lines = [GOOD_ROW, row(dense={"I3": "x"}), GOOD_ROW]
    with gzip.open(root / "day_1.tsv.gz", "wt") as handle:
        handle.write("\n".join(lines) + "\n")
    return [root / "day_0.tsv", root / "day_1.tsv.gz"]


FLAGS = ["--chunk-mb", "0.5", "--eval-fraction", "0.2"]  # ~12 chunks of the generated input


@pytest.fixture(scope="module")
def direct(inputs, tmp_path_factory):
    """The DirectRunner's output on the generated input: what every Dask run must equal."""
    out = tmp_path_factory.mktemp("direct") / "out"
    assert preprocess("-i", *inputs, "-o", out, *FLAGS, *DIRECT) == 0
    return out


@pytest.fixture(scope="module")
def cluster():
    """A running 2-worker Dask cluster, reached with --dask-address."""
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=":0"
    ) as local:
        yield local


def test_local_cluster_matches_direct_runner(inputs, direct, tmp_path, capfd):
    flags = FLAGS
    dask = ["--runner", "Dask", "--dask-workers", "2"]
    assert preprocess("-i", *inputs, "-o", tmp_path / "dask", *flags, *dask) == 0
    captured = capfd.readouterr()
    assert "Dask local cluster: 2 worker process(es), dashboard" in captured.err
    assert "rejected=3" in captured.err  # the progress line
    assert "runner:   DaskRunner (local cluster, 2 worker(s))" in captured.out
    assert "rejected: 3 (bad_label=1, non_numeric_dense=1, wrong_field_count=1)" in captured.out
    meta = json.loads((tmp_path / "dask" / "metadata.json").read_text())
    assert len(meta["splits"]["train"]["files"]) > 3  # several chunks ran as several tasks
    assert meta["rejected_files"] == ["rejected/rejected-00000-of-00002.jsonl",
                                      "rejected/rejected-00001-of-00002.jsonl"]  # fmt: skip
    assert_same_output(direct, tmp_path / "dask")


def test_running_cluster_matches_direct_runner_on_the_real_sample(criteo_sample, cluster, tmp_path):
    flags = ["--split", "hash", "--eval-fraction", "0.1"]
    assert preprocess("-i", criteo_sample, "-o", tmp_path / "direct", *flags, *DIRECT) == 0
    address = ["--runner", "dask", "--dask-address", cluster.scheduler_address, "--quiet"]
    assert preprocess("-i", criteo_sample, "-o", tmp_path / "dask", *flags, *address) == 0
    assert_same_output(tmp_path / "direct", tmp_path / "dask")


def kill_a_worker_mid_job(address, out, argv) -> list:
    """Runs the job on the cluster at `address`, SIGKILLs a worker once chunks are being
    parsed; returns [exit code] or [the exception the job raised]."""
    outcome = []

    def run():
        try:
            outcome.append(preprocess(*argv))
        except Exception as error:  # a runner failure is not a user error: it propagates
            outcome.append(error)

    job = threading.Thread(target=run)
    job.start()
    progress = out / "_temporary" / "progress"
    while job.is_alive() and not (progress.is_dir() and any(progress.iterdir())):
        time.sleep(0.05)
    with distributed.Client(address) as client:
        pids = client.run(os.getpid)
    os.kill(next(iter(pids.values())), signal.SIGKILL)
    job.join(timeout=300)
    assert outcome, "the job did not finish"
    return outcome


@pytest.mark.parametrize("allowed_failures", [3, 0], ids=["dask_retries", "dask_gives_up"])
def test_killed_worker_is_retried_or_fails_cleanly(inputs, direct, tmp_path, allowed_failures):
    flags = FLAGS
    out = tmp_path / "dask"
    with dask.config.set({"distributed.scheduler.allowed-failures": allowed_failures}):
        cluster = distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, host="127.0.0.1", dashboard_address=":0"
        )
    with cluster:
        address = ["--runner", "dask", "--dask-address", cluster.scheduler_address, "--quiet"]
        argv = ["-i", *inputs, "-o", out, *flags, *address]
        outcome = kill_a_worker_mid_job(cluster.scheduler_address, out, argv)
        if outcome == [0]:  # Dask ran the lost tasks again
            assert_same_output(direct, out)
        else:  # or gave up: a one-line error, nothing published, nothing partial left
            assert outcome == [2], outcome  # the KilledWorker as a one-line error
            assert not (out / "_SUCCESS").exists() and not (out / "metadata.json").exists()
            assert not (out / "train").exists() and not (out / "_temporary" / "train").exists()
            assert not (out / "_temporary" / "stats").exists()
        assert preprocess(*argv, "--overwrite") == 0, f"rerun after {outcome}"
    assert_same_output(direct, out)


def test_unreachable_scheduler_leaves_the_output_alone(inputs, tmp_path, capsys):
    out = tmp_path / "out"
    assert preprocess("-i", inputs[1], "-o", out, "--eval-fraction", "0", *DIRECT) == 0
    before = sorted(p.name for p in out.rglob("*"))
    capsys.readouterr()
    flags = ["--runner", "dask", "--dask-address", "tcp://127.0.0.1:9", "--dask-timeout", "2"]
    assert preprocess("-i", inputs[1], "-o", out, "--overwrite", *flags) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(
        "hybridrec preprocess: error: --dask-address tcp://127.0.0.1:9: no Dask"
    )
    assert "\n" not in error
    assert sorted(p.name for p in out.rglob("*")) == before
