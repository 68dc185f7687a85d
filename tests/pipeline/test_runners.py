"""Runner names, per-runner option defaults, and the Dask scheduler check."""

import os
import tempfile

import pytest
from apache_beam.options.pipeline_options import DirectOptions, StandardOptions
from hybridrec.common.errors import UserError
from hybridrec.pipeline import runners


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("direct", "DirectRunner"),
        ("DirectRunner", "DirectRunner"),
        ("DASK", runners.DASK_RUNNER),
        ("daskrunner", runners.DASK_RUNNER),
        ("Prism", "PrismRunner"),
        ("flinkRunner", "FlinkRunner"),
        ("spark", "SparkRunner"),
        ("Dataflow", "DataflowRunner"),
        (runners.DASK_RUNNER, runners.DASK_RUNNER),
        ("apache_beam.runners.direct.direct_runner.DirectRunner",) * 2,
    ],
)
def test_runner_names(name, expected):
    assert runners.resolve_runner(name) == expected


@pytest.mark.parametrize("name", ["dusk", "Runner", "no.such.module.Runner", "apache_beam.Nope"])
def test_unknown_runner_is_one_line_listing_the_names(name):
    with pytest.raises(UserError) as error:
        runners.resolve_runner(name)
    message = str(error.value)
    assert name in message and "\n" not in message
    if "." not in name:
        assert "direct, dask, prism, flink, spark, dataflow" in message


def test_direct_runner_defaults_follow_the_input_size():
    def options(chunk_count, chunk_size, *flags):
        sizes = [chunk_size] * chunk_count
        direct = runners.pipeline_options(list(flags), sizes).view_as(DirectOptions)
        return direct.direct_running_mode, direct.direct_num_workers

    cores = os.cpu_count()
    assert options(1, 10**6) == ("in_memory", 1)
    assert options(1, 10**10) == ("in_memory", 1)  # one chunk: nothing to parallelize
    many = min(cores, 64)
    # several chunks, a large input: one worker per core, threads of one process
    assert options(64, 2**27) == ("in_memory", many)
    assert options(64, 2**27, "--direct_running_mode=in_memory") == ("in_memory", many)
    assert options(64, 10) == ("in_memory", 1)  # small: one worker
    assert options(64, 10, "--direct_running_mode=multi_processing") == ("multi_processing", many)
    assert options(64, 2**27, "--direct_num_workers=3") == ("in_memory", 3)
    flag = "--direct_running_mode=multi_processing"
    assert options(64, 2**27, flag) == ("multi_processing", many)
    assert options(1, 2**27, flag) == ("multi_processing", 1)  # at most one per chunk
    flags = ["--project=p", "--temp_location=gs://b/t"]
    dataflow = runners.pipeline_options(flags, runner="DataflowRunner")
    assert dataflow.view_as(StandardOptions).runner == "DataflowRunner"
    assert "direct_running_mode" not in dataflow.get_all_options(drop_default=True)


def test_dask_gets_one_partition_per_chunk():
    pytest.importorskip("distributed")
    from apache_beam.runners.dask.dask_runner import DaskOptions

    def dask_options(*flags):
        options = runners.pipeline_options(
            list(flags), [100] * 7, runner=runners.DASK_RUNNER, dask_address="tcp://h:1"
        )
        return options.view_as(DaskOptions)

    assert (dask_options().npartitions, dask_options().address) == (7, "tcp://h:1")
    assert dask_options("--dask_npartitions=3").npartitions == 3
    assert dask_options("--dask_partition_size=2").npartitions is None


def test_unreachable_dask_scheduler_fails_within_the_timeout():
    pytest.importorskip("distributed")
    with pytest.raises(UserError) as error:
        runners.check_dask_scheduler("tcp://127.0.0.1:9", timeout=2)
    assert "--dask-address tcp://127.0.0.1:9: no Dask scheduler answered within 2 s" in str(
        error.value
    )


@pytest.mark.parametrize("address", ["notanaddress", "tcp://host-without-port"])
def test_malformed_dask_address_is_named(address):
    pytest.importorskip("distributed")
    with pytest.raises(UserError, match=f"--dask-address {address}: not a scheduler address"):
        runners.check_dask_scheduler(address, timeout=2)


def test_runner_given_as_a_beam_option_is_refused():
    with pytest.raises(UserError, match="give the runner as --runner"):
        runners.pipeline_options(["--runner=DataflowRunner"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--direct_num_worker=2"],
            "unknown flag --direct_num_worker (did you mean --direct_num_workers?)",
        ),  # fmt: skip
        (
            ["--temp-location=gs://b/t"],
            "unknown flag --temp-location (did you mean --temp_location?)",
        ),  # fmt: skip
        (["--project"], "Beam pipeline option argument --project: expected one argument"),
        (["job"], "unexpected argument 'job'"),
    ],
)
def test_arguments_no_beam_option_takes_are_refused(flags, message):
    """Beam drops them with a log warning: a misspelled option would change nothing."""
    with pytest.raises(UserError) as error:
        runners.pipeline_options(["--project=p", *flags], runner="DataflowRunner")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_direct_jobs_run_on_the_direct_engine_and_leave_no_temporary_directory(
    tmp_path, monkeypatch
):
    """The preprocess job and the id counts run on the DirectRunner's own batch engine.
    Beam's DirectRunner would first try to start Prism: a download where the network
    allows (another engine then runs the job), a `beam-temp*` directory left in the
    temporary directory where it does not, one a job."""
    from hybridrec.pipeline import PreprocessConfig, read_metadata, synthetic
    from hybridrec.pipeline.click_job import run_preprocess
    from hybridrec.pipeline.id_counts import count_ids

    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    text, _ = synthetic.generate_block(seed=1, block_index=0, rows=2000)
    raw = tmp_path / "raw.tsv"
    raw.write_bytes(text)
    config = PreprocessConfig(inputs=(str(raw),), output=str(tmp_path / "out"))
    result = run_preprocess(config, quiet=True)
    assert result.metadata["counts"]["rows_read"] == 2000
    counts = count_ids(read_metadata(tmp_path / "out"))
    assert sum(int(c.sum()) for _, c in counts.values()) > 0
    assert not [path.name for path in temporary.iterdir() if path.name.startswith("beam-temp")]
