"""train --follow: exactly once across a kill -9 of the trainer, SIGTERM ends with an export."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from hybridrec.pipeline import PreprocessConfig, read_shards, run_preprocess
from hybridrec.pipeline.follow import FollowConfig, follow
from hybridrec.pipeline.synthetic import generate_block
from hybridrec.training.data.stream_reader import batch_sizes


@pytest.mark.parametrize(
    ("rows", "flush", "expected"),
    [
        (200, False, [64, 64, 64]),
        (200, True, [64, 64, 64, 8]),
        (61, True, [32, 16, 8]),  # 5 rows short of a device multiple wait
        (7, True, []),
    ],
)
def test_batch_sizes_are_full_batches_then_powers_of_two(rows, flush, expected):
    sizes = batch_sizes(rows, 64, 8, flush=flush)
    assert sizes == expected
    assert all(size % 8 == 0 for size in sizes)


def _drop(directory: Path, name: str, rows: int, seed: int) -> None:
    temporary = directory / f".{name}"
    temporary.write_bytes(generate_block(seed, 0, rows)[0])
    temporary.rename(directory / name)


def _position(run_dir: Path, step: int) -> dict:
    path = run_dir / "checkpoints" / "positions" / f"{step:010d}" / "process_0.json"
    return json.loads(path.read_text())


def test_kill_9_then_resume_trains_every_row_once_and_sigterm_publishes(
    tmp_path, training, small_model
):
    root = tmp_path
    (root / "reference.tsv").write_bytes(generate_block(9, 0, 300)[0])
    reference = root / "reference"
    run_preprocess(
        PreprocessConfig(inputs=[str(root / "reference.tsv")], output=str(reference)),
        beam_args=["--direct_num_workers=1"],
        quiet=True,
    )
    inputs, stream, run_dir = root / "in", root / "stream", root / "run"
    inputs.mkdir()
    config = FollowConfig(
        inputs=[str(inputs / "*.tsv")],
        output=str(stream),
        reference=str(reference),
        poll_interval=0.05,
        settle_seconds=0.0,
    )
    for index in range(4):  # rows a multiple of the 8 devices: none waits for more data
        _drop(inputs, f"{index:03d}.tsv", 608 + 8 * index, seed=index)
    follow(config, max_idle=0.2, quiet=True)

    flags = [
        "train", "--follow", str(stream), "--run-dir", str(run_dir), "--config", "quickstart",
        *small_model("data.batch_size=64", "hybrid.staleness=2"),
        "--checkpoint-every", "0.2", "--flush-after", "0.3", "--quiet",
        "--export", str(root / "export"),
    ]  # fmt: skip
    first = training.start(*flags)
    training.wait_for_checkpoint(first, run_dir, 3)
    first.send_signal(signal.SIGKILL)
    first.wait()
    killed_at = training.last_step(run_dir)

    for index in range(4, 6):  # the stream goes on while the trainer is down
        _drop(inputs, f"{index:03d}.tsv", 608 + 8 * index, seed=index)
    follow(config, max_idle=0.2, quiet=True)

    # the resumed run publishes often: the first export full, the next ones deltas
    second = training.start(*flags, "--resume", "--publish-every", "0.5", "--keep-exports", "1")
    published_file = run_dir / "published.jsonl"

    def caught_up(total: int, publishes: int) -> None:
        """Waits until a checkpoint holds `total` rows and `publishes` exports are out."""
        deadline = time.monotonic() + 120
        while True:
            step = training.last_step(run_dir)
            out = published_file.read_text().count("\n") if published_file.exists() else 0
            if step and _position(run_dir, step)["rows"] >= total and out >= publishes:
                return
            assert second.poll() is None, second.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the resumed run did not catch up"
            time.sleep(0.1)

    caught_up(sum(entry.rows for entry in read_shards(stream)), 1)
    # more rows after the first export (however fast the trainer caught up): a delta
    _drop(inputs, "006.tsv", 608 + 8 * 6, seed=6)
    follow(config, max_idle=0.2, quiet=True)
    shards = read_shards(stream)
    total = sum(entry.rows for entry in shards)
    caught_up(total, 1)
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=120) == 0, second.stderr.read()[-3000:]

    final = training.last_step(run_dir)
    assert final > killed_at
    saved = _position(run_dir, final)
    # each shard's rows were trained once: counted batch by batch, restored with the model
    assert saved["rows_by_shard"] == {str(i): entry.rows for i, entry in enumerate(shards)}
    assert saved["rows"] == total
    assert saved["stream"]["shard"] == len(shards) and saved["stream"]["offset"] == 0
    # old embedding snapshots are removed: the two kept manifests and what they read
    manifests = sorted((run_dir / "checkpoints" / "embeddings").glob("manifest-*.json"))
    assert len(manifests) == 2

    # SIGTERM published the final checkpoint; deltas serve exactly what a full export does
    from hybridrec.serving.export import export_run
    from hybridrec.serving.model import ServedModel

    records = (run_dir / "published.jsonl").read_text().splitlines()
    published = [json.loads(line) for line in records]
    assert published[-1]["step"] == final and published[-1]["rows_trained"] == total
    assert published[0]["kind"] == "full" and "delta" in {p["kind"] for p in published[1:]}
    served = ServedModel(root / "export", max_batch=8)
    assert served.manifest["step"] == final
    full_export = export_run(run_dir, root / "full", step=final, quiet=True, name="export")
    assert full_export["kind"] == "full"
    full = ServedModel(root / "full", max_batch=8)
    lines = [line for index in (0, 5) for line in generate_block(index, 0, 64)[0].splitlines()]
    ids, dense = full.encode_rows(lines + generate_block(77, 0, 16)[0].splitlines())
    np.testing.assert_array_equal(served.predict(ids, dense)[0], full.predict(ids, dense)[0])
    np.testing.assert_array_equal(served.predict(ids, dense)[1], full.predict(ids, dense)[1])
    served.close()
    full.close()
