"""The Parquet input stream: exact coverage, shuffling by seed, static shapes, exact resume."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hybridrec.common.errors import UserError
from hybridrec.training.data.input import ParquetReader


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """3 files, 3411 rows; row r has label r, C1 = r, a multi-valued M = [r] * (r % 3) and
    C2 = 7r (the single-valued features travel in one block: its columns keep theirs)."""
    directory = tmp_path_factory.mktemp("parquet")
    paths, start = [], 0
    for index, rows in enumerate((1000, 1137, 1274)):
        values = np.arange(start, start + rows)
        table = pa.table(
            {
                "label": values.astype(np.float32),
                "I1": (values * 0.5).astype(np.float32),
                "C1": values.astype(np.uint64),
                "M": pa.array([[v] * (v % 3) for v in values], type=pa.list_(pa.uint64())),
                "C2": (values * 7).astype(np.uint64),
            }
        )
        path = directory / f"part-{index}.parquet"
        pq.write_table(table, path, row_group_size=300)
        paths.append(path)
        start += rows
    return paths


def _reader(files, **kwargs):
    defaults = dict(
        label="label", dense=["I1"], categorical=["C1", "M", "C2"], multi=["M"], batch_size=64
    )
    return ParquetReader(files, **{**defaults, **kwargs})


def _check_rows(batch):
    assert batch.dense.shape == (64, 1) and batch.labels.shape == (64,)
    assert batch.dense.dtype == np.float32 and batch.ids["C1"].dtype == np.uint64
    assert list(batch.ids) == ["C1", "M", "C2"]  # the features' order
    np.testing.assert_array_equal(batch.ids["C1"].astype(np.float32), batch.labels)
    np.testing.assert_array_equal(batch.ids["C2"], batch.ids["C1"] * np.uint64(7))
    np.testing.assert_array_equal(batch.dense[:, 0], batch.labels * 0.5)
    ragged = batch.ids["M"]
    lengths = np.diff(ragged.offsets)
    np.testing.assert_array_equal(lengths, batch.labels.astype(int) % 3)
    np.testing.assert_array_equal(
        ragged.values.astype(np.float32), np.repeat(batch.labels, lengths)
    )


def test_epoch_is_a_shuffled_permutation_without_repeats(files):
    reader = _reader(files, seed=1, shuffle_buffer=500)
    assert reader.rows == 3411 and reader.batches_per_epoch == 3411 // 64
    batches = list(reader.batches())
    for batch in batches:
        _check_rows(batch)
    labels = np.concatenate([b.labels for b in batches])
    assert len(np.unique(labels)) == len(labels) == 53 * 64
    assert not np.all(np.diff(labels) > 0)  # shuffled
    again = np.concatenate([b.labels for b in _reader(files, seed=1, shuffle_buffer=500).batches()])
    other = np.concatenate([b.labels for b in _reader(files, seed=2, shuffle_buffer=500).batches()])
    np.testing.assert_array_equal(labels, again)
    assert not np.array_equal(labels, other)


@pytest.mark.parametrize("cut", [1, 7, 52, 53, 70])
def test_resume_from_any_position_continues_the_same_stream(files, cut):
    reader = _reader(files, seed=3, shuffle_buffer=700)
    total = reader.batches_per_epoch * 2
    stream = list(reader.batches(num_batches=total))
    assert len(stream) == total
    resumed = list(
        _reader(files, seed=3, shuffle_buffer=700).batches(total, stream[cut - 1].position)
    )
    assert len(resumed) == total - cut
    for expected, got in zip(stream[cut:], resumed, strict=True):
        np.testing.assert_array_equal(expected.labels, got.labels)
        np.testing.assert_array_equal(expected.ids["M"].values, got.ids["M"].values)
    # the second epoch is a different order of the same rows
    first = np.concatenate([b.labels for b in stream[:53]])
    second = np.concatenate([b.labels for b in stream[53:]])
    assert not np.array_equal(first, second)


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_position_after_is_where_the_stream_stands_after_that_many_batches(files, shards):
    # what a job resumed on another process count starts each reader at
    for index in range(shards):
        reader = _reader(files, seed=3, shuffle_buffer=700, shard_index=index, shard_count=shards)
        total = reader.batches_per_epoch * 2
        stream = list(reader.batches(num_batches=total))
        for made in (0, 1, 5, reader.batches_per_epoch - 1, reader.batches_per_epoch, total - 1):
            resumed = list(reader.batches(total, reader.position_after(made)))
            assert len(resumed) == total - made, (index, made)
            for expected, got in zip(stream[made:], resumed, strict=True):
                np.testing.assert_array_equal(expected.labels, got.labels)
                assert expected.position == got.position


def test_sharded_eval_readers_pad_and_cover_every_row_once(files):
    readers = [_reader(files, pad_final=True, shard_index=i, shard_count=2) for i in range(2)]
    assert readers[0].batches_per_epoch == readers[1].batches_per_epoch
    seen = []
    for reader in readers:
        batches = list(reader.batches())
        assert len(batches) == reader.batches_per_epoch
        for batch in batches:
            assert batch.labels.shape == (64,) and len(batch.ids["M"].offsets) == 65
            seen.append(batch.labels[batch.valid])
    seen = np.sort(np.concatenate(seen))
    np.testing.assert_array_equal(seen, np.arange(3411))


def test_too_few_rows_for_one_batch_is_a_user_error(files):
    with pytest.raises(UserError, match="fewer rows"):
        _reader(files[:1], batch_size=4096)
    with pytest.raises(UserError, match="cannot be shared"):
        _reader(files, shard_index=0, shard_count=4)


def _same_batches(expected, got):
    assert len(expected) == len(got)
    for a, b in zip(expected, got, strict=True):
        _check_rows(b)
        assert a.position == b.position
        np.testing.assert_array_equal(a.labels, b.labels)
        np.testing.assert_array_equal(a.dense, b.dense)
        for name in ("C1", "C2"):
            np.testing.assert_array_equal(a.ids[name], b.ids[name])
        np.testing.assert_array_equal(a.ids["M"].offsets, b.ids["M"].offsets)
        np.testing.assert_array_equal(a.ids["M"].values, b.ids["M"].values)


@pytest.mark.parametrize("threads", [2, 5])
def test_windows_read_ahead_on_several_threads_give_the_same_stream(files, threads):
    """The windows after the current one are read on `read_threads` threads, in the
    stream's order: the same batches and positions as one thread, also when the same
    reader is asked for another position while windows are being read ahead."""
    options = dict(seed=3, shuffle_buffer=400)
    one = _reader(files, **options)
    total = one.batches_per_epoch * 2 + 3
    expected = list(one.batches(num_batches=total))
    reader = _reader(files, read_threads=threads, **options)
    _same_batches(expected, list(reader.batches(num_batches=total)))
    partial = reader.batches(num_batches=total, position=expected[9].position)
    _same_batches(expected[10:14], [next(partial) for _ in range(4)])
    _same_batches(expected[60:], list(reader.batches(total, expected[59].position)))


class _Counted(ParquetReader):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read = []

    def _read_window(self, epoch, index, groups):
        self.read.append((epoch, index))
        return super()._read_window(epoch, index, groups)


def test_no_window_past_the_end_of_the_stream_is_read(files):
    options = dict(label="label", dense=["I1"], categorical=["C1", "M", "C2"], multi=["M"])
    reader = _Counted(files, **options, batch_size=64, shuffle_buffer=400, read_threads=4)
    windows = len(reader._epoch_windows(0))
    list(reader.batches(num_batches=reader.batches_per_epoch))  # one epoch: its windows
    assert sorted(reader.read) == [(0, index) for index in range(windows)]
    reader = _Counted(files, **options, batch_size=64, shuffle_buffer=400, read_threads=4)
    list(reader.batches(num_batches=3))  # 192 rows: the first window only
    assert reader.read == [(0, 0)]
    assert reader.position_after(3).window == 0


def test_read_threads_below_one_is_a_user_error(files):
    with pytest.raises(UserError, match="read_threads"):
        _reader(files, read_threads=0)


def test_a_stream_closed_early_forgets_its_windows_but_not_a_newer_streams(files):
    reader = _reader(files, seed=3, shuffle_buffer=400, read_threads=3)
    total = reader.batches_per_epoch
    expected = list(_reader(files, seed=3, shuffle_buffer=400).batches(total))
    first = reader.batches(total)
    _same_batches(expected[:3], [next(first) for _ in range(3)])
    assert reader._ahead  # windows read ahead for it
    first.close()
    assert not reader._ahead
    first, second = reader.batches(total), reader.batches(total, expected[19].position)
    next(first)
    _same_batches(expected[20:22], [next(second) for _ in range(2)])
    first.close()  # an older stream's end leaves the newer one's windows
    assert reader._ahead
    _same_batches(expected[22:], list(second))


def test_row_groups_whose_columns_do_not_match_name_the_file(tmp_path):
    paths = []
    for index, ids in enumerate([np.arange(500, dtype=np.uint64), [f"x{i}" for i in range(500)]]):
        table = pa.table({"label": np.zeros(500, np.float32), "I1": np.zeros(500, np.float32), "C1": ids})  # fmt: skip
        paths.append(tmp_path / f"part-{index}.parquet")
        pq.write_table(table, paths[-1], row_group_size=250)
    reader = ParquetReader(
        paths, label="label", dense=["I1"], categorical=["C1"], batch_size=64, shuffle_buffer=1000
    )
    with pytest.raises(UserError, match="its columns do not match those of") as error:
        list(reader.batches())
    assert "part-0.parquet row group" in str(error.value)  # both files are named
    assert "part-1.parquet row group" in str(error.value) and "C1" in str(error.value)
