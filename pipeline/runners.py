"""Which Beam runner executes the job, with which options, and the Dask cluster it may need.

`--runner` takes a short name (any case, `Runner` suffix optional) or a fully qualified
class name. The DirectRunner gets defaults that fit the input (a worker thread per core
for large inputs); the DaskRunner gets one Dask partition per chunk and either a
running cluster (`--dask-address`) or a local one started for the job and shut down
after it (see docs/pipeline.md, "Runners").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import importlib
import logging
import os
import time
from collections.abc import Iterator, Sequence

from apache_beam.options.pipeline_options import (
    DirectOptions,
    PipelineOptions,
    StandardOptions,
    WorkerOptions,
)
from hybridrec.common.errors import UserError

DASK_RUNNER = "apache_beam.runners.dask.dask_runner.DaskRunner"
# short name -> what Beam's `--runner` option takes
RUNNER_NAMES = {
    "direct": "DirectRunner",
    "dask": DASK_RUNNER,
    "prism": "PrismRunner",
    "flink": "FlinkRunner",
    "spark": "SparkRunner",
    "dataflow": "DataflowRunner",
}
# From this much input on the DirectRunner runs a worker per core. A second worker (a
# thread) paid nothing at 73 MB of Criteo-format text (3 chunks: 1.9-2.2 s with one or
# two) and a quarter of the time at 243 MB (4.0-4.5 s with one, 3.2-3.5 s with two), so
# the threshold sits below where it starts to pay, where it costs little (docs/benchmarks.md)
PARALLEL_MIN_BYTES = 64 * 2**20
# The Dask graph has one partition (one task per step) per chunk, up to this many.
MAX_DASK_PARTITIONS = 4096


def resolve_runner(name: str) -> str:
    """The Beam `--runner` value for `name`: a short name, any case, or a class path.

    Raises:
        UserError: an unknown short name, or a class path that does not import.
    """
    key = name.strip().lower()
    key = key[: -len("runner")] if key.endswith("runner") and key != "runner" else key
    if key in RUNNER_NAMES:
        return RUNNER_NAMES[key]
    choices = ", ".join(RUNNER_NAMES)
    if "." not in name:
        raise UserError(
            f"--runner {name!r}: unknown runner; use one of {choices} (any case, 'Runner' "
            "suffix optional) or a fully qualified class name (package.module.Class)"
        )
    module_name, _, class_name = name.rpartition(".")
    try:
        getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise UserError(f"--runner {name!r}: cannot import it ({error})") from None
    return name


def runner_kind(runner: str) -> str:
    """The short name of a resolved runner ("direct", "dask", ...), else the class name."""
    for short, full in RUNNER_NAMES.items():
        if runner == full:
            return short
    return runner.rsplit(".", 1)[-1]


def _has_flag(beam_args: Sequence[str], *names: str) -> bool:
    return any(arg.split("=", 1)[0] in names for arg in beam_args)


def check_beam_args(
    beam_args: Sequence[str], *, runner: str = "DirectRunner", own_flags: Sequence[str] = ()
) -> None:
    """Refuses an argument that no Beam pipeline option takes: Beam itself drops it with a
    log warning, so a misspelled flag would silently change nothing.

    Args:
        beam_args: the arguments left after the command's own flags.
        runner: a value of `resolve_runner` (which imports a runner given as a class
            path, so the options it defines count as known).
        own_flags: the command's own flags (`--eval-fraction`), suggested before Beam's.

    Raises:
        UserError: the first unknown argument or a bad option value, one line, with the
            closest known flag.
    """
    if runner_kind(runner) == "dask":
        with contextlib.suppress(ImportError):  # without Dask, --runner dask fails later
            import apache_beam.runners.dask.dask_runner  # noqa: F401 - defines DaskOptions
    parsers: list[argparse.ArgumentParser] = []
    PipelineOptions([]).get_all_options(add_extra_args_fn=parsers.append)
    parser = parsers[0]  # the parser Beam reads its options with, every option defined
    parser.exit_on_error = False
    try:
        _, unknown = parser.parse_known_args(list(beam_args))
    except argparse.ArgumentError as error:
        raise UserError(f"Beam pipeline option {error}") from None
    if not unknown:
        return
    name = unknown[0].split("=", 1)[0]
    if not name.startswith("-"):
        raise UserError(
            f"unexpected argument {unknown[0]!r}: it follows no flag that takes a value"
        )
    beam_flags = [option for action in parser._actions for option in action.option_strings]
    # compared with "_" read as "-": Beam's flags use one, the command's the other
    flags = {flag.replace("_", "-"): flag for flag in [*beam_flags, *own_flags]}
    # 0.7: difflib's 0.6 suggests any flag sharing a word ("--...-option")
    close = difflib.get_close_matches(name.replace("_", "-"), list(flags), n=1, cutoff=0.7)
    hint = f" (did you mean {flags[close[0]]}?)" if close else ""
    raise UserError(
        f"unknown flag {name}{hint}: not a flag of this command nor a Beam pipeline option"
    )


def pipeline_options(
    beam_args: Sequence[str],
    input_bytes: Sequence[int] = (),
    *,
    runner: str = "DirectRunner",
    dask_address: str | None = None,
    dask_timeout: float = 10.0,
) -> PipelineOptions:
    """Beam options: the pass-through flags plus defaults that fit the input and the runner.

    Unless the flags say otherwise, the DirectRunner runs in `in_memory` mode, with one
    worker per core (at most one per chunk) when the input has several chunks and at least
    PARALLEL_MIN_BYTES, else with one: the workers are threads of this process (the
    jobs' work is numpy and Arrow calls that release the GIL; threads spare them worker
    processes to start and elements sent through gRPC, which `multi_processing` costs). The
    DaskRunner gets one partition per chunk (its default packs up to 128 elements into
    one partition, which would run every chunk in one task).

    Args:
        beam_args: Beam flags, untouched; one that no Beam option takes is an error.
        input_bytes: [chunks] input bytes of each chunk.
        runner: a value of `resolve_runner`.
        dask_address: the scheduler the DaskRunner connects to.
    """
    if _has_flag(beam_args, "--runner"):
        raise UserError(
            "give the runner as --runner (PreprocessConfig.runner), not as a Beam option"
        )
    check_beam_args(beam_args, runner=runner)
    options = PipelineOptions(list(beam_args))
    standard = options.view_as(StandardOptions)
    standard.runner = runner
    kind = runner_kind(runner)
    if kind == "direct":
        direct = options.view_as(DirectOptions)
        parallel = len(input_bytes) > 1 and sum(input_bytes) >= PARALLEL_MIN_BYTES
        if not _has_flag(beam_args, "--direct_running_mode"):
            direct.direct_running_mode = "in_memory"
        if not _has_flag(beam_args, "--direct_num_workers"):
            cores = os.cpu_count() or 1
            # a large input, or a multi-process / multi-thread mode asked for without a
            # worker count: one worker per core (at most one per chunk)
            many = parallel or direct.direct_running_mode != "in_memory"
            direct.direct_num_workers = max(1, min(cores, len(input_bytes))) if many else 1
    if kind == "dask":
        from apache_beam.runners.dask.dask_runner import DaskOptions

        dask = options.view_as(DaskOptions)
        dask.address = dask_address
        dask.timeout = int(max(1, dask_timeout))
        if not _has_flag(beam_args, "--dask_npartitions", "--dask_partition_size"):
            dask.npartitions = max(1, min(len(input_bytes), MAX_DASK_PARTITIONS))
    harness = options.view_as(WorkerOptions)
    if not _has_flag(beam_args, "--default_sdk_harness_log_level"):
        harness.default_sdk_harness_log_level = "ERROR"
    return options


def make_pipeline(options: PipelineOptions):
    """A Beam pipeline on the runner `options` name. The DirectRunner's batch engine (the
    FnApiRunner, in `direct_running_mode` with `direct_num_workers`) is built here: Beam's
    DirectRunner first tries to start the Prism runner, which downloads a binary where the
    network allows (another engine then runs the job, ignoring those options) and leaves
    a temporary directory behind where it does not."""
    import apache_beam as beam

    if runner_kind(options.view_as(StandardOptions).runner or "DirectRunner") != "direct":
        return beam.Pipeline(options=options)
    from apache_beam.portability.api import beam_provision_api_pb2
    from apache_beam.runners.portability.fn_api_runner import fn_runner
    from apache_beam.runners.portability.portable_runner import JobServiceHandle

    # what the DirectRunner gives its FnApiRunner: the options, for the SDK workers too
    encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options())
    provision = beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded)
    runner = fn_runner.FnApiRunner(provision_info=fn_runner.ExtendedProvisionInfo(provision))
    return beam.Pipeline(runner=runner, options=options)


def describe_runner(options: PipelineOptions, cluster: DaskCluster | None = None) -> str:
    """One line for the summary and metadata.json: runner, mode, workers."""
    runner = options.view_as(StandardOptions).runner
    kind = runner_kind(runner)
    if kind == "direct":
        direct = options.view_as(DirectOptions)
        return f"{runner} ({direct.direct_running_mode}, {direct.direct_num_workers} worker(s))"
    if kind == "dask" and cluster is not None:
        where = "local cluster" if cluster.local else f"cluster at {cluster.address}"
        return f"DaskRunner ({where}, {cluster.workers} worker(s))"
    return str(runner)


@dataclasses.dataclass(frozen=True)
class DaskCluster:
    """The Dask cluster a job runs on."""

    address: str  # scheduler address, tcp://HOST:PORT
    workers: int  # worker processes when the job started
    local: bool  # started for this job (and shut down after it)
    dashboard: str | None  # dashboard URL, when the scheduler serves one


def _distributed():
    try:
        import distributed
    except ImportError:
        raise UserError(
            "--runner dask needs Dask: pip install 'hybridrec[dask]' (or 'dask[distributed]')"
        ) from None
    # Dask logs every connection at INFO; the job reports its own progress.
    logging.getLogger("distributed").setLevel(logging.WARNING)
    return distributed


def check_dask_scheduler(address: str, timeout: float) -> tuple[int, str | None]:
    """Connects to the scheduler at `address` and back; returns (workers, dashboard URL).

    Raises:
        UserError: Dask is not installed, or no scheduler answered within `timeout` s.
    """
    distributed = _distributed()
    try:
        distributed.comm.get_address_host_port(address)
    except ValueError as error:
        raise UserError(
            f"--dask-address {address}: not a scheduler address ({error}); expected tcp://HOST:PORT"
        ) from None
    try:
        client = distributed.Client(address, timeout=f"{timeout}s", set_as_default=False)
    except Exception as error:  # refused, timed out, bad address, or not a Dask scheduler
        detail = " ".join(str(error).split())[:200]
        raise UserError(
            f"--dask-address {address}: no Dask scheduler answered within {timeout:g} s "
            f"({type(error).__name__}: {detail})"
        ) from None
    try:
        return len(client.scheduler_info()["workers"]), client.dashboard_link
    finally:
        client.close()


@contextlib.contextmanager
def dask_cluster(
    address: str | None, *, workers: int = 0, timeout: float = 10.0
) -> Iterator[DaskCluster]:
    """A running Dask cluster for the job: the one at `address`, or a local one.

    Without `address`, starts `workers` worker processes (0: one per core) with one
    thread each on this machine, and shuts them down on exit.

    Raises:
        UserError: Dask is not installed, or no scheduler answered at `address` within
            `timeout` seconds.
    """
    distributed = _distributed()
    if address is not None:
        count, dashboard = check_dask_scheduler(address, timeout)
        yield DaskCluster(address, count, local=False, dashboard=dashboard)
        return
    count = workers or os.cpu_count() or 1
    cluster = distributed.LocalCluster(
        n_workers=count,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address="127.0.0.1:0",
    )
    try:
        yield DaskCluster(cluster.scheduler_address, count, local=True, dashboard=_link(cluster))
    finally:
        cluster.close()


def _link(cluster) -> str | None:
    try:
        return cluster.dashboard_link
    except Exception:  # no dashboard (bokeh missing): nothing to print
        return None


def stop_runner(result, timeout: float = 60.0) -> None:
    """After a failed Dask run: cancels the job's remaining tasks and waits (up to `timeout`
    seconds) until no task is running on the cluster, so that no worker still writes into
    the output once the caller removes the partial files. No-op for other runners."""
    client = getattr(result, "client", None)
    if client is None or not hasattr(result, "cancel"):
        return
    try:
        result.cancel()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _tasks_running(client):
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the cluster is gone: nothing of it still writes
        pass


def _running_threads(dask_worker) -> int:
    return len(dask_worker.active_threads)


def _tasks_running(client) -> bool:
    """Whether any task still runs on the cluster. The scheduler forgets a cancelled task at
    once, while the worker thread running it goes on (and writes) until the task returns:
    so this asks the workers for their busy threads, not only the scheduler."""
    if any(client.processing().values()):
        return True
    return any(client.run(_running_threads, on_error="ignore").values())


def close_runner_client(result) -> None:
    """Closes the Dask client the DaskRunner opened for `result` (Beam leaves it open)."""
    client = getattr(result, "client", None)
    close = getattr(client, "close", None)
    if close is not None:
        close()
