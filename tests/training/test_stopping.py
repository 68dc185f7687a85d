"""Training that stops at its best: the auto values a run with a validation split gets, a
run that stops after `train.patience` evaluations without a better figure, `evaluate` and
`export` reading the best by default, `--resume` keeping the best and the count, and the
bad inputs, one line each."""

from __future__ import annotations

import json
import shutil

import pytest
from hybridrec.common.errors import ConfigError, UserError
from hybridrec.training import stopping
from hybridrec.training.checkpoint import RunCheckpoints
from hybridrec.training.config import TrainConfig, load_config
from hybridrec.training.tasks import TASKS

from tests.training.test_sequence_training import SMALL, events_dataset

# too high a rate for this log: the validation figure rises, then falls
OVERFIT = ["optimizer.learning_rate=0.02", "embedding.optimizer.learning_rate=0.02"]
STOPS = ["data.epochs=40", "eval.every_steps=6", "train.patience=2", "hybrid.staleness=0"]


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    return events_dataset(tmp_path_factory.mktemp("stopping"))


def evals(run) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["hr@10"] for r in records if r["kind"] == "eval"}


def test_auto_values_with_and_without_a_validation_split():
    config = TrainConfig()
    resolved, rule, lines = stopping.resolve(
        config, task=TASKS["events"], validation=True, steps_per_epoch=1234
    )
    assert (rule.metric, rule.every, rule.patience) == ("hr@10", 1234, stopping.AUTO_PATIENCE)
    assert resolved.checkpoint.keep_best == "hr@10" and resolved.train.patience == 5
    assert len(lines) == 3 and rule.adaptive
    tiny = stopping.resolve(config, task=TASKS["events"], validation=True, steps_per_epoch=3)[1]
    assert tiny.every == stopping.AUTO_EVAL_MIN_STEPS
    huge = stopping.resolve(config, task=TASKS["clicks"], validation=True, steps_per_epoch=10**6)[1]
    assert (huge.metric, huge.every) == ("auc", stopping.AUTO_EVAL_MAX_STEPS)
    resolved, rule, lines = stopping.resolve(
        config, task=TASKS["clicks"], validation=False, steps_per_epoch=50
    )
    assert (rule.metric, rule.every, rule.patience, lines) == ("", 0, 0, ())
    assert resolved.eval.every_steps == 0 and resolved.checkpoint.keep_best == ""
    # a stream never stops early; an explicit interval is kept
    assert stopping.resolve(config, task=TASKS['events'], validation=True, steps_per_epoch=9, follow=True)[1].patience == 0  # fmt: skip
    fixed = load_config(None, ["eval.every_steps=7"])
    assert stopping.resolve(fixed, task=TASKS['events'], validation=True, steps_per_epoch=99)[1].every == 7  # fmt: skip


def test_the_interval_widens_when_evaluating_costs_more_than_its_share():
    assert stopping.widened_interval(200, train_seconds=10.0, eval_seconds=1.0) == 200
    # 4 s of evaluation against 2 s of training: 4 * 0.8 / (0.2 * 2) = 8 intervals
    assert stopping.widened_interval(200, train_seconds=2.0, eval_seconds=4.0) == 1600
    wide = stopping.widened_interval(200, train_seconds=2.0, eval_seconds=4.0)
    assert 4.0 / (4.0 + 2.0 * wide / 200) <= stopping.AUTO_EVAL_SHARE + 1e-9


def test_patience_counts_evaluations_since_the_best_and_survives_a_record():
    rule = stopping.StopRule("hr@10", every=10, patience=2)
    patience = stopping.Patience(rule)
    seconds = {"train_seconds": 1.0, "wall_seconds": 2.0}
    assert patience.update(10, {"hr@10": 0.1}, seconds)
    assert not patience.update(20, {"hr@10": 0.1}, seconds)  # equal is not better
    again = stopping.Patience(rule, json.loads(json.dumps(patience.record())))
    assert (again.best_step, again.since) == (10, 1) and not again.exhausted
    assert not again.update(30, {"hr@10": 0.05}, seconds)
    assert again.exhausted and "2 evaluations without a better hr@10" in again.stopped
    lower = stopping.Patience(stopping.StopRule("logloss", every=1, patience=1))
    assert lower.update(1, {"logloss": 0.5}, seconds) and lower.update(2, {"logloss": 0.4}, seconds)


def test_a_run_stops_at_its_best_and_evaluate_and_export_read_it(events, tmp_path, cli):
    import hybridrec

    run = tmp_path / "run"
    config = hybridrec.load_config("sasrec", [*SMALL, *OVERFIT, *STOPS])
    summary = hybridrec.train(config, data=events, run_dir=run, quiet=True)
    scores = evals(run)
    best = max(scores, key=lambda step: (scores[step], -step))
    last = max(scores)
    assert summary["stopped"].startswith("patience: 2 evaluations")
    assert summary["steps"] == last < config.data.epochs * 10  # well before the cap
    assert [s for s in scores if s > best] == [best + 6, best + 12]  # two evaluations, no better
    assert summary["best"]["step"] == best
    assert summary["best"]["value"] == pytest.approx(scores[best])
    assert summary["best"]["wall_seconds_to_best"] > 0
    tested = json.loads(cli("evaluate", "--run", str(run), "--json").stdout)
    assert (tested["step"], tested["hr@10"]) == (best, pytest.approx(scores[best], abs=1e-6))
    assert tested["step_reason"].startswith("the best checkpoint: validation hr@10")
    latest = json.loads(cli("evaluate", "--run", str(run), "--step", "latest", "--json").stdout)
    assert latest["step"] == last
    exported = hybridrec.export(run, tmp_path / "export", quiet=True)
    assert exported["step"] == best and "best" in exported["step_reason"]
    # resuming a run that stopped: one line saying so and how to go on
    with pytest.raises(UserError, match=r"already stopped at step \d+: 2 evaluations"):
        hybridrec.train(config, data=events, run_dir=run, resume=True, quiet=True)


def test_a_resumed_run_keeps_the_best_and_the_count(events, tmp_path):
    """Rolled back to an evaluated checkpoint and resumed, a run stops where the run that
    was never interrupted stopped, with the same best."""
    import hybridrec

    config = hybridrec.load_config("sasrec", [*SMALL, *OVERFIT, *STOPS, "checkpoint.keep=100"])
    whole = tmp_path / "whole"
    expected = hybridrec.train(config, data=events, run_dir=whole, quiet=True)
    scores = evals(whole)
    back_to = sorted(scores)[-2]  # one evaluation before the stop: a count of 1 to keep
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    (resumed / "checkpoints" / "LAST").write_text(json.dumps({"step": back_to}))
    (resumed / "summary.json").unlink()
    again = hybridrec.train(config, data=events, run_dir=resumed, resume=True, quiet=True)
    assert again["steps"] == expected["steps"]
    assert again["best"]["step"] == expected["best"]["step"]
    assert again["best"]["value"] == pytest.approx(expected["best"]["value"])
    assert again["stopped"] == expected["stopped"]
    assert RunCheckpoints(resumed).best()["step"] == expected["best"]["step"]


@pytest.mark.devices(8, launched=True)
@pytest.mark.parametrize("keys", [STOPS, ["data.epochs=2"]], ids=["patience", "auto"])
def test_two_processes_stop_at_the_same_step_with_the_same_best(events, tmp_path, cli, keys):
    """Every process counts the same evaluations (their figures are gathered), so all stop
    together; an auto interval is fixed once, on the chief's measurement, for all."""
    sets = [item for key in (*SMALL, *OVERFIT, *keys) for item in ("--set", key)]
    launch = ["launch", "--num-processes", "2", "--devices-per-process", "4", "--timeout", "200"]
    run = tmp_path / "two"
    common = ["--data", str(events), "--config", "sasrec", "--quiet", *sets]
    cli(*launch, "--", "train", "--run-dir", str(run), *common, timeout=240)
    two = [json.loads((run / "processes" / f"summary_{i}.json").read_text()) for i in range(2)]
    assert two[0]["processes"] == 2
    for key in ("steps", "stopped", "eval_every_steps"):
        assert two[0][key] == two[1][key], key
    best = [{k: v for k, v in s["best"].items() if not k.endswith("_to_best")} for s in two]
    assert best[0] == best[1]
    if keys is STOPS:
        assert two[0]["stopped"].startswith("patience")


def test_a_click_log_with_a_valid_split_stops_on_it_and_reports_eval(tmp_path, cli, small_model):
    """`preprocess --valid-fraction`: the run keeps its best by validation AUC on "valid",
    and `evaluate` reads that checkpoint on "eval", the split its figures are reported on."""
    raw, data = tmp_path / "raw.tsv", tmp_path / "data"
    cli("generate", "--output", str(raw), "--rows", "12000", "--seed", "5")
    cli("preprocess", "--input", str(raw), "--output", str(data), "--valid-fraction", "0.1")
    meta = json.loads((data / "metadata.json").read_text())
    assert {k: v["rows"] for k, v in meta["splits"].items()} == {"train": 9600, "valid": 1200, "eval": 1200}  # fmt: skip
    run = tmp_path / "run"
    keys = small_model("data.epochs=3", "eval.every_steps=10", "train.patience=2")
    cli("train", "--config", "quickstart", "--data", str(data), "--run-dir", str(run), *keys)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best"]["metric"] == "auc"
    valid = {step: auc for step, auc in _aucs(run).items()}
    assert summary["best"]["value"] == pytest.approx(max(valid.values()))
    tested = json.loads(cli("evaluate", "--run", str(run), "--json").stdout)
    assert (tested["step"], tested["split"]) == (summary["best"]["step"], "eval")
    assert tested["count"] == 1200


def _aucs(run) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["auc"] for r in records if r["kind"] == "eval"}


def test_bad_stopping_input_is_one_line(events, tmp_path, dataset):
    import hybridrec

    with pytest.raises(ConfigError, match=r"train.patience must be >= 0 \(0 = off, -1 = auto\), got -3"):  # fmt: skip
        load_config(None, ["train.patience=-3"])
    with pytest.raises(ConfigError, match="train.patience"):
        load_config(None, ["train.patience=1.5"])
    # a click-log dataset has no validation split besides its eval split
    config = hybridrec.load_config("quickstart", ["train.patience=3", "data.max_steps=2"])
    with pytest.raises(UserError, match=r"no validation split besides 'eval'.*--valid-fraction"):
        hybridrec.train(config, data=dataset, run_dir=tmp_path / "clicks", quiet=True)
    config = hybridrec.load_config("sasrec", [*SMALL, "train.patience=3", "checkpoint.keep_best="])
    with pytest.raises(UserError, match="checkpoint.keep_best is empty"):
        hybridrec.train(config, data=events, run_dir=tmp_path / "none", quiet=True)
    run = tmp_path / "nobest"
    config = hybridrec.load_config("sasrec", [*SMALL, "data.max_steps=4", "checkpoint.keep_best="])
    hybridrec.train(config, data=events, run_dir=run, quiet=True)
    with pytest.raises(UserError, match="no best checkpoint recorded"):
        hybridrec.evaluate(run, step="best", quiet=True)
