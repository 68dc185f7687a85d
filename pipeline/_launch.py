"""Running a preprocessing job on its runner, with progress: what the click-log job
(`pipeline.click_job`) and the event-log job (`pipeline.events.event_job`) share.

`run_job` readies the output directory, starts a Dask cluster when the runner is Dask,
builds the pipeline options from the input's size, sends the workers' start-up chatter to
a log file, runs the graph the caller builds and shows progress from the workers' progress
files. A failed run leaves no partial output and re-raises an input error as the one line
a worker raised it with.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
from collections.abc import Callable, Sequence

from apache_beam.io.filesystems import FileSystems
from hybridrec.common.errors import UserError
from hybridrec.common.progress import Progress
from hybridrec.pipeline import _errors, _output, runners


def run_job(
    config,
    chunks: Sequence,
    build: Callable[[object, str, str | None], None],
    *,
    beam_args: Sequence[str] = (),
    quiet: bool = False,
    outputs: Sequence[str] = _output.OUTPUTS,
) -> tuple[str, Progress, str]:
    """Runs the graph `build(pipeline, temp_dir, progress_dir)` adds to a pipeline.

    Args:
        config: the job's config (output, overwrite, runner and Dask settings).
        chunks: the input chunks (their bytes size the runner and the progress).
        outputs: the dataset's top-level names a new one replaces.

    Returns:
        (temporary directory, progress, the runner described in a line).
    """
    runner = runners.resolve_runner(config.runner)
    dask = runners.runner_kind(runner) == "dask"
    if dask and config.dask_address:
        runners.check_dask_scheduler(config.dask_address, config.dask_timeout)
    out = config.output
    _output.prepare(out, config.overwrite, outputs)
    temp_dir = FileSystems.join(out, _output.TEMP_DIR)
    local = "://" not in out
    progress_dir = os.path.join(temp_dir, "progress") if local else None
    if progress_dir:
        os.makedirs(progress_dir, exist_ok=True)
    log_path = os.path.join(temp_dir, _output.LOG_FILE) if local else None
    with contextlib.ExitStack() as stack:
        terminal = stack.enter_context(stderr_to_file(log_path))
        stream = open(os.devnull, "w") if quiet else terminal  # noqa: SIM115
        cluster = None
        if dask:
            cluster = stack.enter_context(
                runners.dask_cluster(
                    config.dask_address, workers=config.dask_workers, timeout=config.dask_timeout
                )
            )
            if cluster.local:
                print(
                    f"[preprocess] Dask local cluster: {cluster.workers} worker process(es), "
                    f"dashboard {cluster.dashboard or 'unavailable (pip install bokeh)'}",
                    file=stream,
                    flush=True,
                )
        options = runners.pipeline_options(
            beam_args,
            [chunk.input_bytes for chunk in chunks],
            runner=runner,
            dask_address=cluster.address if cluster else None,
            dask_timeout=config.dask_timeout,
        )
        pipeline = runners.make_pipeline(options)
        build(pipeline, temp_dir, progress_dir)
        total_bytes = sum(chunk.input_bytes for chunk in chunks)
        try:
            progress = run_with_progress(pipeline, progress_dir, total_bytes, stream)
        except BaseException:
            _output.discard_partial(temp_dir)
            if log_path and os.path.exists(log_path):
                print(f"hybridrec preprocess: Beam worker log: {log_path}", file=terminal)
            raise
        runner_line = runners.describe_runner(options, cluster)
    progress.stream = stream if quiet else sys.stderr
    return temp_dir, progress, runner_line


@contextlib.contextmanager
def stderr_to_file(path: str | None):
    """Sends file descriptor 2 (inherited by worker processes) to `path`.

    Beam's and Dask's worker processes log start-up chatter to stderr; it goes to a log
    file so the terminal shows only progress and the summary. Yields a stream to the
    real stderr.
    """
    if path is None:
        yield sys.stderr
        return
    sys.stderr.flush()
    saved = os.dup(2)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 2)
    os.close(log)
    terminal = os.fdopen(os.dup(saved), "w")
    try:
        yield terminal
    finally:
        terminal.flush()
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        terminal.close()


def run_with_progress(pipeline, progress_dir: str | None, total_bytes: int, stream) -> Progress:
    """Runs the pipeline; on a local output, shows progress from the workers' progress files."""
    failure: list[BaseException] = []

    def run():
        result = None
        try:
            result = pipeline.run()
            result.wait_until_finish()
        except BaseException as error:  # re-raised on the calling thread
            failure.append(error)
            runners.stop_runner(result)  # tasks still running would write after the cleanup
        finally:
            runners.close_runner_client(result)

    scale, unit = (2**20, "MB") if total_bytes >= 2**20 else (2**10, "kB")
    progress = Progress("preprocess", total=total_bytes / scale, unit=unit, stream=stream)
    thread = threading.Thread(target=run, name="beam-pipeline", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=1.0)
        if progress_dir and os.path.isdir(progress_dir):
            consumed, lines, rejected = _read_progress(progress_dir)
            rows_per_s = f"{lines / max(progress.elapsed, 1e-9):,.0f}"
            done = consumed / scale - progress.count
            progress.update(done, rows=lines, rows_per_s=rows_per_s, rejected=rejected)
    if failure:
        error = failure[0]
        match = re.search(
            rf"\[{_errors.INPUT_ERROR_MARK}\] (.*?) \[/{_errors.INPUT_ERROR_MARK}\]",
            str(error),
            re.S,
        )
        if match:
            raise UserError(match.group(1)) from None
        if type(error).__name__ == "KilledWorker":  # distributed.KilledWorker, as Dask names it
            raise UserError(
                "the Dask job failed: worker processes died running the same task until Dask "
                f"stopped retrying it (distributed.scheduler.allowed-failures): {error.args[0]!r}; "
                "nothing was published, rerun the same command"
            ) from None
        raise error
    return progress


def _read_progress(progress_dir: str) -> tuple[int, int, int]:
    """(input bytes consumed, lines read, rows rejected) over all chunks so far."""
    consumed, lines, rejected = 0, 0, 0
    for name in os.listdir(progress_dir):
        try:
            with open(os.path.join(progress_dir, name)) as handle:
                state = json.load(handle)
        except (OSError, ValueError):
            continue  # being replaced right now
        consumed += state["bytes"]
        lines += state["lines"]
        rejected += state.get("rejected", 0)
    return consumed, lines, rejected
