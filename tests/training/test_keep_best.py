"""checkpoint.keep_best: the checkpoint with the best validation metric outlives the newest
`keep` ones (dense state, position and embeddings), `--step best` evaluates and exports
it, and a metric the run does not have is one line at start-up."""

from __future__ import annotations

import json

import pytest
from hybridrec.common.errors import UserError
from hybridrec.training.checkpoint import RunCheckpoints

from tests.training.test_sequence_training import SMALL, events_dataset


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    return events_dataset(tmp_path_factory.mktemp("keep_best"))


def test_the_best_checkpoint_is_kept_and_named_best(events, tmp_path, cli):
    import hybridrec

    keys = [
        *SMALL,
        "data.max_steps=40",
        "checkpoint.every_steps=10",
        "eval.every_steps=10",
        "checkpoint.keep=1",
        "checkpoint.keep_best=hr@10",
        "optimizer.learning_rate=0.02",  # too high: the metric rises, then falls
        "embedding.optimizer.learning_rate=0.02",
    ]
    config = hybridrec.load_config("sasrec", keys)
    run = tmp_path / "run"
    hybridrec.train(config, data=events, run_dir=run, quiet=True)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["hr@10"] for r in records if r["kind"] == "eval"}
    best_step = max(evals, key=lambda step: (evals[step], -step))
    checkpoints = RunCheckpoints(run, keep=1, keep_best="hr@10")
    best = checkpoints.best()
    assert best["step"] == best_step and best["value"] == pytest.approx(evals[best_step])
    complete = checkpoints.complete_steps()
    assert complete == sorted({best_step, 40})  # the newest and the best, nothing else
    checkpoints.close()
    tested = json.loads(cli("evaluate", "--run", str(run), "--step", "best", "--json").stdout)
    assert tested["step"] == best_step
    assert tested["hr@10"] == pytest.approx(evals[best_step], abs=1e-6)
    exported = hybridrec.export(run, tmp_path / "export", step="best", quiet=True)
    assert exported["step"] == best_step


def test_a_metric_the_run_does_not_have_is_one_line(events, tmp_path):
    import hybridrec

    config = hybridrec.load_config("sasrec", [*SMALL, "checkpoint.keep_best=auc"])
    with pytest.raises(UserError, match=r"keep_best = 'auc' is not a metric of this run \(hr@10"):
        hybridrec.train(config, data=events, run_dir=tmp_path / "run", quiet=True)
