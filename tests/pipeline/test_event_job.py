"""The event-log job against a plain-Python reference: every user's history, in every split.

The reference groups the same events by user, orders them by (time, input position),
drops exact duplicates, leaves out users below min_events and cuts histories to
max_length, one user at a time; the job (several chunks, several buckets) must write the
same lists. Also: time windows, the user-per-line form, Parquet input, item features,
capped users, and each bad input's message.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hybridrec.common.errors import UserError
from hybridrec.pipeline import hashing
from hybridrec.pipeline.config import PreprocessConfig
from hybridrec.pipeline.events import _event_inputs
from hybridrec.pipeline.events._histories import IdIndex
from hybridrec.pipeline.events.event_job import run_event_preprocess
from hybridrec.pipeline.events.event_spec import load_event_spec
from hybridrec.pipeline.events.synthetic_events import EventLogConfig, generate_events

SPEC = """kind = "events"
name = "test_events"
header = true
columns = ["user_id", "item_id", "timestamp", "action", "device"]
user = "user_id"
item = "item_id"
time = "timestamp"
max_length = {max_length}
min_events = 3
max_events_per_user = {cap}

[action]
column = "action"
values = ["view", "click", "like", "skip"]

[[event_features]]
name = "device"

[items]
path = "items.csv"
id = "item_id"
features = ["category", "brand"]
{split}
"""


def write_spec(root: Path, max_length=8, cap=10_000, split="") -> Path:
    path = root / "spec.toml"
    path.write_text(SPEC.format(max_length=max_length, cap=cap, split=split))
    return path


def run(inputs, out, spec, workers=1, **options):
    config = PreprocessConfig(
        inputs=[str(p) for p in inputs], output=str(out), spec=str(spec), **options
    )
    flags = ["--direct_running_mode=in_memory", f"--direct_num_workers={workers}"]
    return run_event_preprocess(config, quiet=True, beam_args=flags)


def item_id(raw: str, spec) -> int:
    raw_hash = hashing.hash_bytes_list([raw.encode()])
    return int(hashing.feature_ids(raw_hash, np.zeros(1, bool), spec.prefix("item"), 8)[0])


def user_id(raw: str, spec) -> int:
    raw_hash = hashing.hash_bytes_list([raw.encode()])
    return int(hashing.feature_ids(raw_hash, np.zeros(1, bool), spec.prefix("user"), 8)[0])


def reference_histories(lines: list[str], spec) -> dict[int, list[tuple[int, int]]]:
    """user id -> [(item id, time)] in time order, ties in input order, duplicates
    dropped, users below min_events left out."""
    by_user: dict[str, list] = {}
    seen = set()
    for position, line in enumerate(lines):
        user, item, time, action, device = line.split(",")
        if spec.drop_duplicates and line in seen:
            continue
        seen.add(line)
        by_user.setdefault(user, []).append((int(time), position, item))
    out = {}
    for user, events in by_user.items():
        if len(events) < spec.min_events:
            continue
        events.sort()
        out[user_id(user, spec)] = [(item_id(item, spec), time) for time, _, item in events]
    return out


def read_split(out: Path, meta: dict, split: str) -> dict[int, dict]:
    tables = [pq.read_table(out / name) for name in meta["splits"][split]["files"]]
    rows = pa.concat_tables(tables).to_pylist()
    users = [row["user"] for row in rows]
    assert len(users) == len(set(users)), "one row a user"
    return {row["user"]: row for row in rows}


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    """A generated log, and a second file: duplicates of the first's last two events (recent
    ones: kept) and an event earlier than its user's others."""
    root = tmp_path_factory.mktemp("events")
    config = EventLogConfig(users=600, items=300, topics=10, mean_events=12, seed=3)
    generate_events(root / "events.csv", root / "items.csv", config, quiet=True)
    lines = (root / "events.csv").read_text().splitlines()
    extra = [lines[-1], lines[-2], "u3,i7,1700000000,like,tv"]
    (root / "more.csv").write_text("\n".join([lines[0], *extra]) + "\n")
    return root, lines[1:] + extra


def test_leave_one_out_equals_the_reference(log, tmp_path):
    root, lines = log
    spec_path = write_spec(root, max_length=8)
    spec = load_event_spec(spec_path)
    # small chunks and buckets: users spread over chunks and several buckets
    inputs = [root / "events.csv", root / "more.csv"]
    result = run(inputs, tmp_path / "out", spec_path, chunk_mb=0.05, bucket_mb=0.1)
    meta, out = result.metadata, tmp_path / "out"
    assert len(meta["splits"]["train"]["files"]) > 1
    reference = reference_histories(lines, spec)
    valid, test = read_split(out, meta, "valid"), read_split(out, meta, "test")
    train = read_split(out, meta, "train")
    assert set(test) == set(valid) == set(reference)
    for user, events in reference.items():
        items = [item for item, _ in events]
        assert test[user]["items"] == items[-9:]  # history of 8 + the target
        assert test[user]["first_target"] == len(test[user]["items"]) - 1
        assert valid[user]["items"] == items[:-1][-9:]
        assert test[user]["times"] == [time for _, time in events][-9:]
        if len(items) - 2 >= 2:
            assert train[user]["items"] == items[:-2][-8:] and train[user]["first_target"] == 1
        else:
            assert user not in train
    sequence = meta["sequence"]
    assert sequence["duplicates_dropped"] == 2
    assert sequence["users"] == len(reference)
    assert sequence["truncated_histories"] == sum(len(e) - 2 > 8 for e in reference.values())
    assert sum(sequence["actions"].values()) == len(lines)
    assert meta["tables"]["item"]["distinct_estimate"] <= 300
    assert meta["splits"]["test"]["rows"] == len(reference)


def test_item_and_event_features_per_position(log, tmp_path):
    root, _ = log
    spec_path = write_spec(root)
    spec = load_event_spec(spec_path)
    meta = run([root / "events.csv", root / "more.csv"], tmp_path / "out", spec_path).metadata
    items = (root / "items.csv").read_text().splitlines()[1:]
    category_of = {}
    for line in items:
        item, category, _ = line.split(",")
        raw = hashing.hash_bytes_list([category.encode()])
        prefix = spec.prefix("category")
        category_of[item_id(item, spec)] = int(
            hashing.feature_ids(raw, np.zeros(1, bool), prefix, 8)[0]
        )
    rows = read_split(tmp_path / "out", meta, "test")
    for row in list(rows.values())[:50]:
        assert row["category"] == [category_of[item] for item in row["items"]]
        assert len(row["device"]) == len(row["items"]) and len(row["brand"]) == len(row["items"])
        assert set(row["actions"]) <= {1, 2, 3, 4}


def test_time_windows(log, tmp_path):
    root, lines = log
    split = '[split]\nkind = "time"\nwidth = "7d"\nwindows = 2\n'
    spec_path = write_spec(root, max_length=5, split=split)
    spec = load_event_spec(spec_path)
    meta = run([root / "events.csv", root / "more.csv"], tmp_path / "out", spec_path).metadata
    last = max(int(line.split(",")[2]) for line in lines)
    week = 7 * 86400
    assert meta["boundaries"] == [last + 1 - 2 * week, last + 1 - week, last + 1]
    b0, b1, b2 = meta["boundaries"]
    reference = reference_histories(lines, spec)
    window = read_split(tmp_path / "out", meta, "window_1")
    train = read_split(tmp_path / "out", meta, "train")
    for user, events in reference.items():
        before = [item for item, time in events if time < b0]
        inside = [item for item, time in events if b0 <= time < b1]
        if len(before) >= 2:
            assert train[user]["items"] == before[-5:]
        if inside:
            assert window[user]["items"] == before[-5:] + inside
            assert window[user]["first_target"] == len(before[-5:])
        else:
            assert user not in window
    assert "window_2" in meta["splits"] and "test" not in meta["splits"]


def test_direct_and_dask_write_the_same_bytes(log, tmp_path):
    pytest.importorskip("distributed")
    root, _ = log
    spec_path = write_spec(root)
    options = dict(chunk_mb=0.05, bucket_mb=0.1)
    direct = run([root / "events.csv"], tmp_path / "direct", spec_path, **options).metadata
    # the default for a large input: a worker thread per core (two here)
    threads = run([root / "events.csv"], tmp_path / "threads", spec_path, 2, **options).metadata
    assert threads.pop("runner") == "DirectRunner (in_memory, 2 worker(s))"
    dask = run(
        [root / "events.csv"],
        tmp_path / "dask",
        spec_path,
        runner="dask",
        dask_workers=2,
        **options,
    ).metadata
    assert direct.pop("runner").startswith("DirectRunner")
    assert dask.pop("runner").startswith("DaskRunner")
    assert direct == dask == threads
    assert len(direct["splits"]["train"]["files"]) > 1  # several buckets, several chunks
    for split in [*direct["splits"].values(), direct["item_names"]]:
        for name in split["files"]:
            expected = (tmp_path / "direct" / name).read_bytes()
            assert (tmp_path / "dask" / name).read_bytes() == expected
            assert (tmp_path / "threads" / name).read_bytes() == expected


def test_item_names_give_every_hashed_item_its_raw_id(log, tmp_path):
    root, lines = log
    spec_path = write_spec(root)
    spec = load_event_spec(spec_path)
    out = tmp_path / "out"
    inputs = [root / "events.csv", root / "more.csv"]
    meta = run(inputs, out, spec_path, chunk_mb=0.05, bucket_mb=0.1).metadata
    files = meta["item_names"]["files"]
    assert len(files) > 1  # several buckets
    table = pa.concat_tables([pq.read_table(out / name) for name in files])
    names = dict(
        zip(table.column("item").to_pylist(), table.column("name").to_pylist(), strict=True)
    )
    assert len(names) == table.num_rows == meta["item_names"]["rows"]
    raw = {line.split(",")[1] for line in lines}
    assert names == {item_id(item, spec): item.encode() for item in raw}


def test_user_per_line_and_parquet_inputs_give_the_same_histories(tmp_path):
    # the benchmark form: `user item item ...`, gzipped
    with gzip.open(tmp_path / "seq.txt.gz", "wt") as handle:
        handle.write("1 10 11 12 13\n2 20 21\n3 30 31 32\n")
    (tmp_path / "seq.toml").write_text(
        'kind = "events"\nname = "seq"\nformat = "user_per_line"\ndelimiter = "whitespace"\n'
    )
    meta = run([tmp_path / "seq.txt.gz"], tmp_path / "out", tmp_path / "seq.toml").metadata
    spec = load_event_spec(tmp_path / "seq.toml")
    test = read_split(tmp_path / "out", meta, "test")
    assert test[user_id("1", spec)]["items"] == [item_id(i, spec) for i in ("10", "11", "12", "13")]
    assert user_id("2", spec) not in test  # two events: below min_events
    assert meta["sequence"]["users_below_min_events"] == 1
    # the same events as Parquet rows with integer ids and a position as the time
    rows = [
        (u, i, t)
        for u, items in ((1, [10, 11, 12, 13]), (3, [30, 31, 32]))
        for t, i in enumerate(items)
    ]
    table = pa.table({k: [r[j] for r in rows] for j, k in enumerate(("user", "item", "time"))})
    pq.write_table(table, tmp_path / "seq.parquet")
    (tmp_path / "pq.toml").write_text(
        'kind = "events"\nname = "pq"\ncolumns = ["user", "item", "time"]\nuser = "user"\n'
        'item = "item"\ntime = "time"\ntime_format = "unix"\n'
    )
    parquet = run([tmp_path / "seq.parquet"], tmp_path / "pq", tmp_path / "pq.toml").metadata
    again = read_split(tmp_path / "pq", parquet, "test")
    assert {u: r["items"] for u, r in again.items()} == {u: r["items"] for u, r in test.items()}


def test_capped_users_are_named_and_counted(tmp_path):
    lines = ["user_id,item_id,timestamp,action,device"]
    lines += [f"bot,i{k % 50},{1700000000 + k},view,tv" for k in range(400)]
    lines += [f"u{u},i{k},{1700000000 + k},click,tv" for u in range(5) for k in range(4)]
    (tmp_path / "events.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "items.csv").write_text("item_id,category,brand\ni1,c1,b1\n")
    spec_path = write_spec(tmp_path, max_length=20, cap=100)
    meta = run([tmp_path / "events.csv"], tmp_path / "out", spec_path, chunk_mb=0.002).metadata
    assert meta["sequence"]["capped_users"] == 1
    assert meta["sequence"]["capped_users_named"] == [["bot", 400]]
    test = read_split(tmp_path / "out", meta, "test")
    assert len(test) == 6 and max(len(row["items"]) for row in test.values()) == 21


@pytest.mark.parametrize(
    "content,message",
    [
        (
            "user_id,item_id,timestamp,action,device\nu1,i1,1700000000,view,tv\n"
            "u1,i2,2024-05-01,view,tv\n",
            "events.csv: line 3: the time column mixes formats: '2024-05-01' is not unix seconds",
        ),
        (
            "user,item_id,timestamp,action,device\nu1,i1,1700000000,view,tv\n",
            "events.csv: line 1: header does not match spec",
        ),
        ("", "no input rows: every input file is empty"),
        (
            "user_id,item_id,timestamp,action,device\nu1,i1,1700000000,view,tv\n",
            "no user has 3 events or more (min_events)",
        ),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path, content, message):
    (tmp_path / "events.csv").write_text(content)
    (tmp_path / "items.csv").write_text("item_id,category,brand\ni1,c1,b1\n")
    spec_path = write_spec(tmp_path)
    with pytest.raises(UserError) as raised:
        run([tmp_path / "events.csv"], tmp_path / "out", spec_path)
    assert message in str(raised.value)
    assert not (tmp_path / "out" / "_SUCCESS").exists()


def test_rejected_rows_name_their_file_line_and_reason(tmp_path):
    lines = ["user_id,item_id,timestamp,action,device"]
    lines += [f"u{u},i{k},{1700000000 + k},view,tv" for u in range(3) for k in range(3)]
    lines += [",i1,1700000000,view,tv", "u9,i1,later,view,tv", "u9,i1,1700000000,jump,tv", "u9,i1"]
    (tmp_path / "events.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "items.csv").write_text("item_id,category,brand\ni1,c1,b1\n")
    meta = run([tmp_path / "events.csv"], tmp_path / "out", write_spec(tmp_path)).metadata
    records = [
        json.loads(line)
        for name in meta["rejected"]["files"]
        for line in (tmp_path / "out" / name).read_text().splitlines()
    ]
    assert [(r["line"], r["reason"]) for r in records] == [
        (11, "missing_user"),
        (12, "bad_time"),
        (13, "bad_action"),
        (14, "wrong_field_count"),
    ]
    assert "'jump' is not one of view, click, like, skip" in records[2]["detail"]
    assert meta["rejected"]["by_reason"] == {
        "bad_action": 1,
        "bad_time": 1,
        "missing_user": 1,
        "wrong_field_count": 1,
    }


def test_a_click_log_reader_refuses_an_event_dataset_in_one_line(log, tmp_path):
    from hybridrec.pipeline import read_metadata

    root, _ = log
    run([root / "events.csv"], tmp_path / "out", write_spec(root))
    with pytest.raises(UserError, match="is an event-log dataset"):
        read_metadata(tmp_path / "out")


def test_a_non_integer_token_in_user_per_line_names_line_and_token(tmp_path):
    (tmp_path / "seq.txt").write_text("1 10 11 12\n2 20 x21 22\n")
    (tmp_path / "seq.toml").write_text(
        'kind = "events"\nname = "seq"\nformat = "user_per_line"\ndelimiter = "whitespace"\n'
    )
    with pytest.raises(
        UserError, match=r"seq.txt: line 2: token 3 \(item 2\) is 'x21', not an integer"
    ):
        run([tmp_path / "seq.txt"], tmp_path / "out", tmp_path / "seq.toml")


def test_the_id_index_finds_what_a_binary_search_finds():
    """The item join's hash index against searchsorted: random ids, ids that differ only in
    a few high bits, absent ids, one id, none."""
    rng = np.random.default_rng(4)
    clustered = np.arange(5000, dtype=np.uint64) << np.uint64(40)  # same low bits
    ids = np.unique(np.concatenate([rng.integers(0, 2**64 - 1, 20_000, np.uint64), clustered]))
    queries = np.concatenate([ids[rng.integers(len(ids), size=50_000)], rng.integers(0, 2**64 - 1, 1000, np.uint64)])  # fmt: skip
    position = np.minimum(np.searchsorted(ids, queries), len(ids) - 1)
    expected = np.where(ids[position] == queries, position, -1)
    np.testing.assert_array_equal(IdIndex(ids).find(queries), expected)
    assert (expected[-1000:] == -1).all()
    np.testing.assert_array_equal(IdIndex(ids[:1]).find(ids[:3]), [0, -1, -1])
    np.testing.assert_array_equal(IdIndex(ids[:0]).find(ids[:3]), [-1, -1, -1])


def test_item_features_are_loaded_once_while_held_and_again_when_the_file_changes(log):
    root, _ = log
    spec = load_event_spec(write_spec(root))
    first = _event_inputs.shared_item_features(spec)
    assert first.index is not None  # built once, before any thread reads it
    assert _event_inputs.shared_item_features(spec) is first
    fresh = _event_inputs.load_item_features(spec)
    assert np.array_equal(fresh.items, first.items)
    assert all(np.array_equal(fresh.ids[n], first.ids[n]) for n in fresh.ids)
    items = Path(spec.items.path)
    original = items.read_bytes()
    try:
        lines = original.decode().splitlines()
        items.write_text("\n".join(lines[:-1]) + "\n")  # one item fewer: a new file
        changed = _event_inputs.shared_item_features(spec)
        assert changed is not first and len(changed.items) == len(first.items) - 1
    finally:
        items.write_bytes(original)
