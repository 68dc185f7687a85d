"""The real command line, end to end: generate -> preprocess -> train -> evaluate -> plot."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq

HASH_BUCKETS = 1 << 18


def _load(dataset, split):
    metadata = json.loads((dataset / "metadata.json").read_text())
    files = metadata["splits"][split]["files"]
    tables = [pq.read_table(dataset / f) for f in files]
    dense_names = metadata["spec"]["dense"]
    categorical = [c["name"] for c in metadata["spec"]["categorical"]]
    dense = np.concatenate(
        [np.stack([t.column(n).to_numpy() for n in dense_names], 1) for t in tables]
    ).astype(np.float64)
    ids = np.concatenate(
        [np.stack([t.column(n).to_numpy() for n in categorical], 1) for t in tables]
    )
    labels = np.concatenate([t.column("label").to_numpy() for t in tables]).astype(np.float64)
    return dense, ids, labels


def _auc(scores, labels):
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    # average ranks of ties
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    sums = np.zeros(len(counts))
    np.add.at(sums, inverse, ranks)
    ranks = (sums / counts)[inverse]
    positives = labels.sum()
    negatives = len(labels) - positives
    return (ranks[labels == 1].sum() - positives * (positives + 1) / 2) / (positives * negatives)


def logistic_regression_auc(dataset, epochs=2, learning_rate=0.1, batch=256):
    """Eval AUC of a hashed one-hot + dense logistic regression trained with Adagrad."""
    train_dense, train_ids, train_labels = _load(dataset, "train")
    eval_dense, eval_ids, eval_labels = _load(dataset, "eval")
    mean, std = train_dense.mean(0), train_dense.std(0) + 1e-6
    columns = np.arange(train_ids.shape[1], dtype=np.uint64)

    def buckets(ids):
        return ((ids * np.uint64(0x9E3779B97F4A7C15) + columns) % np.uint64(HASH_BUCKETS)).astype(
            np.int64
        )

    train_buckets, eval_buckets = buckets(train_ids), buckets(eval_ids)
    w_dense = np.zeros(train_dense.shape[1])
    w_sparse = np.zeros(HASH_BUCKETS)
    bias = 0.0
    g_dense, g_sparse, g_bias = np.full_like(w_dense, 1e-6), np.full_like(w_sparse, 1e-6), 1e-6
    rng = np.random.default_rng(0)
    for _ in range(epochs):
        order = rng.permutation(len(train_labels))
        for start in range(0, len(order), batch):
            rows = order[start : start + batch]
            x = (train_dense[rows] - mean) / std
            b = train_buckets[rows]
            logits = x @ w_dense + w_sparse[b].sum(1) + bias
            error = (1 / (1 + np.exp(-logits)) - train_labels[rows]) / len(rows)
            grad_dense = x.T @ error
            grad_sparse = np.zeros_like(w_sparse)
            np.add.at(grad_sparse, b.ravel(), np.repeat(error, b.shape[1]))
            touched = np.unique(b)
            g_dense += grad_dense**2
            g_sparse[touched] += grad_sparse[touched] ** 2
            g_bias += error.sum() ** 2
            w_dense -= learning_rate * grad_dense / np.sqrt(g_dense)
            w_sparse[touched] -= learning_rate * grad_sparse[touched] / np.sqrt(g_sparse[touched])
            bias -= learning_rate * error.sum() / np.sqrt(g_bias)
    scores = ((eval_dense - mean) / std) @ w_dense + w_sparse[eval_buckets].sum(1) + bias
    return _auc(scores, eval_labels)


def test_cli_train_evaluate_plot_beats_logistic_regression(
    dataset, tmp_path, cli, small_model, training
):
    hybridrec, overrides = cli, small_model
    run_dir = tmp_path / "run"
    keys = overrides("data.epochs=2", "checkpoint.every_steps=100", "eval.every_steps=100")
    train = hybridrec(*training.args(dataset, run_dir, *keys))
    assert "training finished" in train.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["staleness_max"] <= 4
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "eval"][-1] == summary["steps"]
    # Logging does not wait for running steps; the records say what was trained by then,
    # and everything is by the last one.
    train = [r for r in records if r["kind"] == "train"]
    done = [r["samples_done"] for r in train]
    assert done == sorted(done) and all(d <= r["samples"] for d, r in zip(done, train, strict=True))
    assert done[-1] == train[-1]["samples"] == summary["samples"]
    # XLA compiles while training, counted as they happen: the step's at least, none undone
    compiled = [r["compiles"] for r in train]
    assert compiled == sorted(compiled) and 1 <= compiled[0] <= compiled[-1] <= summary["compiles"]
    assert 0 < train[0]["compile_s"] <= summary["compile_s"]
    assert any(p.name.startswith("events.out") for p in (run_dir / "tensorboard").iterdir())

    evaluated = json.loads(hybridrec("evaluate", "--run", str(run_dir), "--json").stdout)
    assert evaluated["step"] == summary["steps"] == summary["checkpoint_step"]
    # the checkpoint evaluates to what training measured at its last step
    assert abs(evaluated["auc"] - summary["eval"]["auc"]) < 1e-6
    assert evaluated["count"] == summary["eval"]["count"]

    baseline = max(logistic_regression_auc(dataset, epochs=e) for e in (1, 2))
    print(f"hybrid DLRM AUC {evaluated['auc']:.4f} vs logistic regression {baseline:.4f}")
    assert evaluated["auc"] > baseline + 0.01

    hybridrec("plot", str(run_dir))
    assert (run_dir / "plots" / "curves.png").stat().st_size > 10_000


def test_quickstart_runs_end_to_end_and_serves_its_model(tmp_path, cli):
    out = tmp_path / "quickstart"
    result = cli("quickstart", "--rows", "20000", "--out", str(out), "--set", "data.batch_size=256")
    scores = [
        float(line.split("click probability")[1])
        for line in result.stdout.splitlines()
        if "click probability" in line
    ]
    assert len(scores) == 5 and all(0.0 < score < 1.0 for score in scores)
    assert json.loads((out / "run" / "summary.json").read_text())["eval"]["count"] > 0
    assert (out / "run" / "plots" / "curves.png").stat().st_size > 0
    assert any((out / "export").glob("*/manifest.json"))


def test_a_missing_platform_or_an_uneven_batch_is_one_line(dataset, tmp_path, training):
    """JAX_PLATFORMS naming a platform this machine lacks (cuda on a CPU host), or a
    batch that the devices do not divide, ends `train` with one line naming it."""
    platforms = ["nosuchplatform"] + ([] if shutil.which("nvidia-smi") else ["cuda"])
    cases = [({"JAX_PLATFORMS": p}, f"JAX_PLATFORMS={p}: JAX cannot start") for p in platforms]
    uneven = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    cases.append((uneven, "data.batch_size = 256 must divide evenly over 3 devices"))
    for index, (env, message) in enumerate(cases):
        args = training.args(dataset, tmp_path / f"run{index}", "--set", "data.batch_size=256")
        result = subprocess.run(
            [sys.executable, "-m", "hybridrec", *args],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, result.stderr[-2000:]
        assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]
