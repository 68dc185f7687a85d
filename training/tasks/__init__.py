"""The kinds of run (`training.task.Task`), and `prepare`, which asks the dataset's.

task_of(metadata)   the task of a dataset: click logs or user histories
prepare(config)     a process's `Job`: the multi-process job joined, the dataset read,
                    and the config resolved and checked by its task
"""

from __future__ import annotations

from typing import Any

from hybridrec.common.errors import UserError
from hybridrec.embedding_store.remote.client import ServerSet
from hybridrec.model import maybe_initialize_distributed
from hybridrec.pipeline import DatasetMetadata, EventMetadata, read_dataset
from hybridrec.training.config import TrainConfig
from hybridrec.training.job import Job
from hybridrec.training.task import Task
from hybridrec.training.tasks.click_task import ClickLogTask
from hybridrec.training.tasks.sequence_task import SequenceTask

# a dataset's metadata kind -> its task
TASKS: dict[str, Task] = {"clicks": ClickLogTask(), "events": SequenceTask()}


def task_of(metadata: DatasetMetadata | EventMetadata) -> Task:
    """The task that trains a dataset of this kind."""
    return TASKS[metadata.kind]


def prepare(
    config: TrainConfig,
    *,
    distributed: dict[str, Any] | None = None,
    servers: ServerSet | None = None,
    follow: bool = False,
) -> Job:
    """Joins the multi-process job (if any) and checks the config against the data and
    devices, through the dataset's task.

    Args:
        config: the run's configuration.
        distributed: coordinator / num_processes / process_id of a multi-process job.
        servers: the remote shard servers as the command resolved them; None:
            `embedding.servers`, no token.
        follow: the run trains a followed stream (no tables on the devices: new ids
            arrive without end).
    """
    maybe_initialize_distributed(**(distributed or {}))
    if not config.data.path:
        raise UserError(
            "no data: pass --data DIR (a `hybridrec preprocess` output) or set data.path"
        )
    metadata = read_dataset(config.data.path)
    return task_of(metadata).prepare(config, metadata, servers=servers, follow=follow)
