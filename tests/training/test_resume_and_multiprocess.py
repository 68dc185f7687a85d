"""Crash safety (SIGKILL, then --resume) and a 2-process job, through the real command line."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest


def test_sigkill_then_resume_finishes_from_the_last_complete_checkpoint(
    dataset, tmp_path, cli, small_model, training
):
    run_dir = tmp_path / "run"
    total = 60
    keys = small_model(f"data.max_steps={total}", "checkpoint.every_steps=10", "hybrid.staleness=2")
    process = training.start(*training.args(dataset, run_dir, "--quiet", *keys))
    try:
        training.wait_for_checkpoint(process, run_dir, 10)
        time.sleep(0.3)  # somewhere after a checkpoint: maybe in the next one
        os.kill(process.pid, signal.SIGKILL)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        process.stderr.close()
    killed_at = training.last_step(run_dir)
    assert killed_at is not None and 10 <= killed_at < total, killed_at

    # the committed checkpoint is whole: dense state, data position, embeddings
    root = run_dir / "checkpoints"
    assert (root / "dense" / str(killed_at)).is_dir()
    assert (root / "positions" / f"{killed_at:010d}" / "process_0.json").exists()
    assert (root / "embeddings" / f"manifest-{killed_at:012d}.json").exists()

    resumed = cli("train", "--run-dir", str(run_dir), "--resume", "--quiet")
    assert "training finished" in resumed.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == total and summary["checkpoint_step"] == total
    assert summary["samples"] == total * 256
    steps = [
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open() if '"train"' in line
    ]
    assert steps == sorted(set(steps)) and steps[-1] == total  # one clean history
    assert json.loads(cli("evaluate", "--run", str(run_dir), "--json").stdout)["step"] == total
    # checkpoint.keep (2) holds for every part, embedding snapshots included, as with --follow
    manifests = sorted(path.name for path in (root / "embeddings").glob("manifest-*.json"))
    assert manifests == [f"manifest-{step:012d}.json" for step in (total - 10, total)]
    assert sorted(path.name for path in (root / "positions").iterdir()) == [
        f"{step:010d}" for step in (total - 10, total)
    ]


# tables on the devices: 13 split by rows over both processes' devices, 13 replicated
DEVICE_TABLES = [
    "embedding.device_budget=-1",
    *(f"embedding.placement.C{i}=device:sharded" for i in range(1, 14)),
]


# hot-row caches in front of host tables: one evicting all the time, one split by rows
CACHES = [
    "embedding.device_budget=-1",
    "embedding.placement.C3=cache:64",
    "embedding.placement.C12=cache:3000:sharded",
    *(f"embedding.placement.C{i}=host" for i in range(14, 27) if i != 12),
]


@pytest.mark.devices(8, launched=True)
@pytest.mark.parametrize(
    "placement", [[], DEVICE_TABLES, CACHES], ids=["host_store", "device_tables", "caches"]
)
def test_two_processes_agree_on_the_final_metrics(dataset, tmp_path, cli, small_model, placement):
    # k = 0 and one shard: the 2-process job must match one process with the same 8 devices
    keys = small_model(
        "data.max_steps=20", "hybrid.staleness=0", "embedding.num_shards=1", *placement
    )
    common = ["--data", str(dataset), "--config", "quickstart", "--quiet", *keys]
    run_dir = tmp_path / "two"
    launched = cli(
        "launch",
        "--num-processes",
        "2",
        "--devices-per-process",
        "4",
        "--timeout",
        "200",
        "--",
        "train",
        "--run-dir",
        str(run_dir),
        *common,
        timeout=240,
    )
    # the collectives connected (the run finished), but Gloo's connection lines stay out
    assert "[Gloo]" not in launched.stdout + launched.stderr
    summaries = [
        json.loads((run_dir / "processes" / f"summary_{i}.json").read_text()) for i in range(2)
    ]
    for summary in summaries:
        assert summary["processes"] == 2 and summary["devices"] == 8
        assert summary["steps"] == 20
    assert summaries[0]["eval"] == summaries[1]["eval"]  # every process reports the same
    assert summaries[0]["eval"]["count"] == 4000
    assert summaries[0]["device_tables"] == summaries[1]["device_tables"]
    assert bool(summaries[0]["device_tables"]) == bool(placement)
    if placement is CACHES:  # both processes admitted and evicted the same rows
        caches = summaries[0]["device_tables"]["caches"]
        assert caches["cache.replicated"]["evicted"] > 0 and caches["cache.sharded"]["hits"] > 0

    cli("train", "--run-dir", str(tmp_path / "one"), *common)
    single = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert single["processes"] == 1
    for key in ("auc", "logloss"):
        assert abs(single["eval"][key] - summaries[0]["eval"][key]) < 2e-3, key


@pytest.mark.devices(8, launched=True)
def test_resume_on_another_process_count_continues_the_step_and_epoch(
    dataset, tmp_path, cli, small_model
):
    # 2 processes to step 10, then 1 process on to 20 from their checkpoint: the global
    # step, the samples and the share of the epoch carry over (ParquetReader.position_after)
    keys = small_model("hybrid.staleness=0", "checkpoint.every_steps=10")
    run_dir = tmp_path / "run"
    common = ["--data", str(dataset), "--config", "quickstart", "--quiet", *keys]
    launch = ["launch", "--num-processes", "2", "--devices-per-process", "4", "--timeout", "200"]
    cli(*launch, "--", "train", "--run-dir", str(run_dir), *common, "--set", "data.max_steps=10", timeout=240)  # fmt: skip
    positions = run_dir / "checkpoints" / "positions" / f"{10:010d}"
    assert sorted(path.name for path in positions.iterdir()) == [
        "process_0.json",
        "process_1.json",
    ]
    cli("train", "--run-dir", str(run_dir), "--resume", *common, "--set", "data.max_steps=20")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["processes"] == 1 and summary["steps"] == 20
    assert summary["samples"] == 20 * 256
    saved = json.loads((run_dir / "checkpoints" / "positions" / f"{20:010d}" / "process_0.json").read_text())  # fmt: skip
    assert saved["position"]["batches"] == 20 and saved["samples"] == 20 * 256
    steps = [
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open() if '"train"' in line
    ]
    assert steps == sorted(set(steps)) and steps[-1] == 20
    assert 0.5 < summary["eval"]["auc"] <= 1.0


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
