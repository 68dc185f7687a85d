"""The task interface: each kind of run implements every member of `training.task.Task`
with its signature, the dataset's metadata picks the task, and each task answers for its
own kind (metrics, the figure a best is kept by, the validation split, the tower kind)."""

from __future__ import annotations

import inspect

import pytest
from hybridrec.common.errors import UserError
from hybridrec.model.custom import tower_kind
from hybridrec.training.config import TrainConfig, load_config
from hybridrec.training.task import Task
from hybridrec.training.tasks import TASKS, task_of


@pytest.mark.parametrize("kind", sorted(TASKS))
def test_every_task_implements_the_protocol_with_its_signatures(kind):
    task = TASKS[kind]
    expected = {name for name in Task.__annotations__} | {
        name for name, value in vars(Task).items() if inspect.isfunction(value)
    }
    expected = {name for name in expected if not name.startswith("_")}
    assert expected <= set(dir(task)), f"{type(task).__name__} lacks {expected - set(dir(task))}"
    for name, member in vars(Task).items():
        if not inspect.isfunction(member) or name.startswith("_"):
            continue
        wanted = list(inspect.signature(member).parameters)
        got = list(inspect.signature(getattr(type(task), name)).parameters)
        assert got == wanted, f"{type(task).__name__}.{name}{got} is not Task.{name}{wanted}"
    assert isinstance(task.name, str) and isinstance(task.whole_batch, bool)


class _Metadata:
    def __init__(self, kind):
        self.kind = kind


def test_the_dataset_picks_its_task_and_each_answers_for_its_kind():
    clicks, sequences = task_of(_Metadata("clicks")), task_of(_Metadata("events"))
    assert (clicks.name, sequences.name) == ("clicks", "sequences")
    assert (clicks.tower_kind, sequences.tower_kind) == ("pooled", "sequence")
    assert tower_kind("dlrm") == clicks.tower_kind and tower_kind("hstu") == sequences.tower_kind
    assert not clicks.whole_batch and sequences.whole_batch
    config = TrainConfig()
    assert clicks.judged_by(config) == "auc" and sequences.judged_by(config) == "hr@10"
    assert clicks.metric_names(config) == {"auc", "logloss", "ne", "calibration"}
    assert {"hr@10", "ndcg@10", "hr@10_history_kept"} <= sequences.metric_names(config)
    ranking = load_config(None, ["model.sequence.objective='ranking'"])
    assert sequences.judged_by(ranking) == "auc" and "hr@10" not in sequences.metric_names(ranking)
    # a click log reports on "eval" and stops on "valid"; histories stop on their eval split
    assert clicks.validation_split(config) == "valid"
    assert sequences.validation_split(config) == config.data.eval_split
    assert "--valid-fraction" in clicks.no_validation(config)
    assert "leave-one-out" in sequences.no_validation(config)
    assert clicks.positions_per_row(config) == 0
    assert sequences.positions_per_row(load_config(None, ["model.sequence.max_length=48"])) == 48


def test_a_tower_of_the_other_kind_is_refused_by_the_task(tmp_path):
    class Root:
        root = tmp_path

    with pytest.raises(UserError, match="reads user histories, but .* click-log dataset"):
        TASKS["clicks"].resolve(load_config("hstu", []), Root(), 1)
    with pytest.raises(UserError, match="reads click-log features, but .* user histories"):
        TASKS["events"].resolve(load_config(None, ["model.tower='dlrm'"]), Root(), 1)
