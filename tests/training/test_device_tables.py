"""Embedding tables on the devices (8 CPU devices): the same training as the host store,
checkpoints that restore anywhere, and one-line errors for placements that cannot be."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hybridrec.embedding_store.checkpoint import read_table_rows
from hybridrec.training.device.plan import available_host_memory

from hybridrec.cli.server_processes import start_servers, stop_servers

REPO_ROOT = Path(__file__).resolve().parents[2]
# the small model keeps every table on the host (embedding.device_budget = 0); these runs
# plan their own placement (-1 = auto). Adagrad from a zero accumulator takes a full step
# on a row's first gradient however small, so the float-rounding differences of the device
# math (1e-7) could grow to 1e-2 within a few steps of a new row; the accumulators start
# at optax's 0.1, as in test_placement.
SYNC = [
    "hybrid.staleness=0",
    "embedding.optimizer.initial_accumulator=0.1",
    "eval.max_batches=4",
    "log.every_steps=1000",
    "embedding.device_budget=-1",
]
# half of the tables split by rows over the 8 devices, the others replicated (planned)
SHARDED = [f"embedding.placement.C{i}=device:sharded" for i in range(1, 14)]


def _train(cli, training, small_model, dataset, run_dir, *keys, resume=False):
    extra = ["--resume"] if resume else []
    result = cli(*training.args(dataset, run_dir, *small_model(*SYNC, *keys), *extra))
    return json.loads((run_dir / "summary.json").read_text()), result.stdout


def _rows(run_dir: Path, step: int) -> tuple[np.ndarray, np.ndarray]:
    return read_table_rows(str(run_dir / "checkpoints" / "embeddings"), step, "embeddings")


def _assert_same_rows(a: Path, b: Path, step: int) -> None:
    ids_a, values_a = _rows(a, step)
    ids_b, values_b = _rows(b, step)
    np.testing.assert_array_equal(ids_a, ids_b)
    np.testing.assert_allclose(values_a, values_b, rtol=1e-4, atol=2e-6)


def _like_host_then_resumed(run, tmp_path: Path, placements: dict[str, list[str]]):
    """Trains 24 steps with every table in the store and with each of `placements`, and
    asserts that at staleness 0 they all run the same math: losses, evaluation and the
    rows of the mid-run and final checkpoints (every row's latest value, wherever it was
    trained) agree. Then resumes each placed run's checkpoint to step 36 as a host-only
    run ("<name>_to_host") and with its placement again, the host run from its own, and
    asserts that all agree.

    Returns per placement the summaries (host, placed, resumed host-only, resumed placed)
    and what the placed run printed.
    """
    steps = ["data.max_steps=24", "checkpoint.every_steps=12"]
    more = ["data.max_steps=36", "checkpoint.every_steps=12"]
    host, _ = run(tmp_path / "host", *steps, "embedding.device_budget=0")
    out = {}
    for name, placement in placements.items():
        placed, printed = run(tmp_path / name, *steps, *placement)
        assert placed["final_loss"] == pytest.approx(host["final_loss"], rel=1e-4)
        assert placed["eval"]["auc"] == pytest.approx(host["eval"]["auc"], abs=1e-4)
        for step in (12, 24):
            _assert_same_rows(tmp_path / "host", tmp_path / name, step)
        shutil.copytree(tmp_path / name, tmp_path / f"{name}_to_host")
        to_host, _ = run(
            tmp_path / f"{name}_to_host", *more, "embedding.device_budget=0", resume=True
        )
        again, _ = run(tmp_path / name, *more, *placement, resume=True)
        out[name] = (placed, to_host, again), printed
    on_host, _ = run(tmp_path / "host", *more, "embedding.device_budget=0", resume=True)
    for name, ((_, to_host, again), _) in out.items():
        assert to_host["steps"] == again["steps"] == on_host["steps"] == 36
        for resumed in (to_host, again):
            assert resumed["eval"]["auc"] == pytest.approx(on_host["eval"]["auc"], abs=1e-4)
        for resumed in (f"{name}_to_host", name):
            _assert_same_rows(tmp_path / "host", tmp_path / resumed, 36)
    return {name: ((host, *runs), printed) for name, (runs, printed) in out.items()}


def test_device_tables_train_like_the_host_store_and_restore_anywhere(
    cli, dataset, tmp_path, training, small_model
):
    """Whole tables on the devices, their ids mapped to rows by the host and by the step
    (`embedding.map_ids`), against the host store."""

    def run(run_dir, *keys, resume=False):
        return _train(cli, training, small_model, dataset, run_dir, *keys, resume=resume)

    runs = _like_host_then_resumed(
        run,
        tmp_path,
        {
            "devices": [*SHARDED, "embedding.map_ids=host"],
            "mapped": [*SHARDED, "embedding.map_ids=devices"],
        },
    )
    for (host, devices, _, on_devices), printed in runs.values():
        assert (
            "device tables: 26 of 26 tables on the devices (13 replicated, 13 split by rows)"
            in printed
        )
        assert host["device_tables"] == {} and devices["device_tables"]["lookups"] == 24 * 256 * 26
        rows = devices["device_tables"]["rows"]
        assert rows and on_devices["device_tables"]["rows"]  # the rows came back onto the devices
        assert sum(on_devices["device_tables"]["rows"].values()) > sum(rows.values())
    printed = {name: text for name, (_, text) in runs.items()}
    assert "ids mapped to rows on the devices, in the step" in printed["mapped"]
    assert "ids mapped to rows on the devices" not in printed["devices"]
    # both ways give the tables the same rows (the same distinct ids)
    mapped, host_mapped = runs["mapped"][0][1], runs["devices"][0][1]
    assert mapped["device_tables"]["rows"] == host_mapped["device_tables"]["rows"]


# hot-row caches in front of host tables, beside whole tables on the devices and host-only
# ones: C3's and C16's share one replicated cache of 128 rows, far fewer than their hot
# ids (it evicts every step); C12's is split by rows over the 8 devices, its rows planned
CACHED = [
    *SHARDED[:6],
    "embedding.placement.C3=cache:64",
    "embedding.placement.C16=cache:64",
    "embedding.placement.C12=cache:sharded",
    *(f"embedding.placement.C{i}=host" for i in range(17, 27)),
]


def test_hot_row_caches_train_like_the_host_store_and_restore_into_host_only(
    cli, dataset, tmp_path, training, small_model
):
    def run(run_dir, *keys, resume=False):
        return _train(cli, training, small_model, dataset, run_dir, *keys, resume=resume)

    # cached rows (trained on the devices) and the others (in the store) run the host
    # store's math; the caches start empty on resume and fill from the store
    (_, cached, _, again), printed = _like_host_then_resumed(run, tmp_path, {"cached": CACHED})[
        "cached"
    ]
    assert "3 of them with a hot-row cache on the devices" in printed
    assert "C3: host store, hot-row cache of 64 rows, replicated" in printed
    assert "C12: host store, hot-row cache of" in printed and "rows, split by rows" in printed
    caches = cached["device_tables"]["caches"]
    assert set(caches) == {"cache.replicated", "cache.sharded"}
    small = caches["cache.replicated"]
    assert small["evicted"] > 100  # smaller than the hot set: evicting every step
    assert small["lookups"] == 2 * 24 * 256 and caches["cache.sharded"]["lookups"] == 24 * 256
    for counts in caches.values():
        assert 0 < counts["hit_rate"] < 1
    assert again["device_tables"]["caches"]["cache.sharded"]["hits"] > 0


def test_tables_and_caches_on_the_devices_of_a_trainer_in_front_of_a_shard_server(
    cli, dataset, tmp_path, training, small_model
):
    """One trainer process with whole tables and hot-row caches on its devices, the rest
    on an embedding server: rows come from the server and go back to it over the wire
    (take_rows, write_rows, read_rows), and at staleness 0 the run is the in-process
    host-only run: the same losses, and the server's checkpoints hold the same rows."""
    steps = ["data.max_steps=24", "checkpoint.every_steps=12"]
    host, _ = _train(cli, training, small_model, dataset, tmp_path / "host", *steps,
                     "embedding.device_budget=0")  # fmt: skip
    keys = small_model(*SYNC, *steps, *CACHED)
    servers = start_servers(
        1, num_shards=2, config="quickstart", data=dataset, overrides=keys[1::2], log_dir=tmp_path
    )
    env = {"HYBRIDREC_EMBEDDING_SERVERS": servers[0].address}
    try:
        result = cli(*training.args(dataset, tmp_path / "served", *keys), env=env)
        served = json.loads((tmp_path / "served" / "summary.json").read_text())
        assert "3 of them with a hot-row cache on the devices" in result.stdout
        assert served["final_loss"] == pytest.approx(host["final_loss"], rel=1e-4)
        assert served["eval"]["auc"] == pytest.approx(host["eval"]["auc"], abs=1e-4)
        assert served["device_tables"]["caches"]["cache.replicated"]["evicted"] > 100
        for step in (12, 24):
            _assert_same_rows(tmp_path / "host", tmp_path / "served", step)
        # a resumed run reads the device tables' rows back from the server
        more = small_model(*SYNC, "data.max_steps=30", "checkpoint.every_steps=12", *CACHED)
        cli(*training.args(dataset, tmp_path / "served", *more, "--resume"), env=env)
        resumed = json.loads((tmp_path / "served" / "summary.json").read_text())
        assert resumed["steps"] == 30 and resumed["device_tables"]["rows"]
    finally:
        assert stop_servers(servers) == [0]


# half of the tables on the devices (6 split by rows, 7 replicated), the others on the server
MIXED = [*SHARDED[:6], *(f"embedding.placement.C{i}=host" for i in range(14, 27))]


@pytest.mark.devices(8, launched=True)
def test_device_tables_of_two_trainer_processes_sharing_a_shard_server(
    cli, dataset, tmp_path, training, small_model
):
    """Two trainer processes (4 devices each) in front of one embedding server, reading
    the global batch (data.global_order): both map the same ids to the same device rows,
    the chief alone writes them back to the server, and its checkpoints hold every row;
    a resumed job reads them back onto the devices. The host tables are trained on the
    shared server as usual (each process's own rows, so not bit for bit the in-process
    run); the job ends where the in-process host-only run does."""
    steps = ["data.max_steps=24", "checkpoint.every_steps=12"]
    host, _ = _train(cli, training, small_model, dataset, tmp_path / "host", *steps,
                     "embedding.device_budget=0")  # fmt: skip
    keys = small_model(*SYNC, *steps, *MIXED, "data.global_order=true")
    servers = start_servers(
        1, num_shards=2, config="quickstart", data=dataset, overrides=keys[1::2], log_dir=tmp_path
    )
    env = {"HYBRIDREC_EMBEDDING_SERVERS": servers[0].address}
    launch = ["launch", "--num-processes", "2", "--devices-per-process", "4", "--timeout", "200"]
    run_dir = tmp_path / "two"

    def summaries() -> list[dict]:
        return [
            json.loads((run_dir / "processes" / f"summary_{i}.json").read_text()) for i in range(2)
        ]

    try:
        train = ["--", *training.args(dataset, run_dir, *keys)]
        result = cli(*launch, *train, env=env, timeout=240)
        assert "device tables: 13 of 26 tables on the devices (7 replicated, 6 split" in (
            result.stdout
        )
        assert "no hot-row caches: several trainer processes share the embedding servers" in (
            result.stdout
        )
        # the auto budget: the processes' smallest free memory, gathered without overflow
        free = re.search(r"auto: 25% of ([\d.,]+) GiB free host memory shared by 4", result.stdout)
        assert free, result.stdout
        gib = float(free.group(1).replace(",", "")) * 2**30
        assert 0.5 < gib / (available_host_memory() / 4) < 2
        first, second = summaries()
        assert first["processes"] == 2 and first["steps"] == 24
        assert first["device_tables"] == second["device_tables"]  # the same rows everywhere
        assert first["device_tables"]["lookups"] == 24 * 256 * 13
        assert first["eval"] == second["eval"]
        assert first["eval"]["auc"] == pytest.approx(host["eval"]["auc"], abs=2e-3)
        # every row in the server's checkpoints, near the host run's. A host row that both
        # processes saw in a step gets two Adagrad pushes where the in-process run sums the
        # gradients into one, in an order that varies with the machine's load: most rows
        # agree to 1e-6, 0.02-2% drift past 1e-5 and a few up to a few 1e-4; a tenth of
        # the learning rate (0.05) bounds them all
        for step in (12, 24):
            ids, values = _rows(run_dir, step)
            host_ids, host_values = _rows(tmp_path / "host", step)
            np.testing.assert_array_equal(ids, host_ids)
            drift = np.abs(values - host_values).max(axis=1)
            assert drift.max() < 5e-3, drift.max()
            assert np.median(drift) < 1e-6 and np.mean(drift > 1e-4) < 0.01, np.sort(drift)[-20:]
        # resumed with the ids mapped in the step: each process's step maps the global
        # batch's ids alike, the chief writes the rows back
        more = small_model(*SYNC, "data.max_steps=30", "checkpoint.every_steps=12", *MIXED,
                           "data.global_order=true", "embedding.map_ids=devices")  # fmt: skip
        result = cli(*launch, "--", *training.args(dataset, run_dir, *more, "--resume"),
                     env=env, timeout=240)  # fmt: skip
        assert "ids mapped to rows on the devices, in the step" in result.stdout
        first, second = summaries()
        assert first["steps"] == 30 and first["device_tables"]["mapped_on_devices"]
        assert first["device_tables"] == second["device_tables"]
        rows = sum(first["device_tables"]["rows"].values())
        ids, _ = _rows(run_dir, 30)
        assert 0 < rows <= len(ids)  # the device tables' rows among the server's
        # a cache there is a one-line error naming the key, from each trainer
        refused = subprocess.run(
            [sys.executable, "-m", "hybridrec", *launch, "--", *training.args(
                dataset, tmp_path / "cached", *keys, "--set", "embedding.placement.C3=cache")],
            cwd=REPO_ROOT, env={**os.environ, **env}, capture_output=True, text=True,
            timeout=240,
        )  # fmt: skip
        assert refused.returncode != 0
        expected = (
            "embedding.placement.C3 = 'cache', but several trainer processes share the "
            "embedding servers: hot-row caches cannot be used here"
        )
        assert expected in refused.stdout + refused.stderr
        assert "Traceback" not in refused.stdout + refused.stderr
    finally:
        assert stop_servers(servers) == [0]


def _refused(dataset: Path, run_dir: Path, *keys: str) -> str:
    settings = [item for key in keys for item in ("--set", key)]
    result = subprocess.run(
        [sys.executable, "-m", "hybridrec", "train", "--config", "quickstart"]
        + ["--data", str(dataset), "--run-dir", str(run_dir), "--quiet", *settings],
        cwd=REPO_ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        (["embedding.placement.C99=device"], "embedding.placement.C99: no table 'C99'"),
        (["embedding.placement.C1=devices"], "embedding.placement.C1 = 'devices': use"),
        (
            ["embedding.device_budget=4096", "embedding.placement.C1=device"],
            "embedding.device_budget = 4,096 bytes per device (embedding.device_budget) is "
            "too small for table 'C1' forced onto the devices",
        ),
        (
            ["embedding.admission.min_count=2", "embedding.placement.C2=device"],
            "embedding.placement.C2 = 'device': table 'C2' cannot be trained on the devices: "
            "it admits ids by count",
        ),
        (
            ["embedding.fuse_tables=false", "embedding.placement.C3=device:10"],
            "embedding table 'C3' on the devices (features C3) is full: 10 rows",
        ),
        (
            [
                "embedding.fuse_tables=false",
                "embedding.placement.C3=device:10",
                "embedding.map_ids=devices",
            ],
            "embedding table 'C3' on the devices (features C3) is full: its 10 rows hold 10 ids",
        ),
        (
            ["embedding.placement.C4=cache:5000", "embedding.map_ids=devices"],
            "embedding.placement.C4 = 'cache:5000', but ids are mapped to rows in the step",
        ),
        (
            ["embedding.capacity=50", "embedding.placement.C3=device"],
            "embedding.placement.C3 = 'device': its features'",
        ),
        (
            ["embedding.device_budget=100000", "embedding.placement.C4=cache:5000"],
            "embedding.device_budget = 100,000 bytes per device (embedding.device_budget) is "
            "too small for the cache of table 'C4' forced by embedding.placement",
        ),
        (
            ["embedding.eviction.ttl_steps=100", "embedding.placement.C5=cache"],
            "embedding.placement.C5 = 'cache': table 'C5' cannot be trained on the devices: "
            "its rows expire",
        ),
    ],
    ids=[
        "unknown_table",
        "bad_value",
        "budget_too_small",
        "admission",
        "table_full",
        "table_full_ids_mapped_in_the_step",
        "cache_with_ids_mapped_in_the_step",
        "ids_past_capacity",
        "cache_budget_too_small",
        "cache_of_unplaceable_table",
    ],
)
def test_placements_that_cannot_be_are_one_line_errors(dataset, tmp_path, keys, expected):
    line = _refused(dataset, tmp_path / "run", "data.max_steps=4", *keys)
    assert expected in line, line


def test_tables_whose_ids_outgrow_the_capacity_are_planned_as_caches(dataset, tmp_path, cli):
    """embedding.capacity below the ids a table sees: the host store evicts the least
    recently used rows past it, a table on the devices cannot, so the plan gives such a
    table a cache (it once placed it whole and training stopped when it filled)."""
    run_dir = tmp_path / "run"
    settings = ["data.max_steps=6", "embedding.capacity=2000", "checkpoint.every_steps=0"]
    result = cli(
        "train", "--config", "quickstart", "--data", str(dataset), "--run-dir", str(run_dir),
        *[item for key in settings for item in ("--set", key)],
    )  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6
    caches = summary["device_tables"]["caches"]
    assert caches, result.stdout
