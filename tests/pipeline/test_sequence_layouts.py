"""The layouts sequential datasets come in, each from `hybridrec spec --sample` to the
histories `preprocess` writes: `user item` pairs (the SASRec paper's files), a `user,item`
CSV with a header and no time, MovieLens-1M's `::`-separated ratings.dat, MovieLens-20M's
ratings.csv and one user a line. Every layout of the same events gives the same histories:
a user's items in time order (file order without a time), repeats kept."""

from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hybridrec.common.errors import UserError
from hybridrec.pipeline import hashing
from hybridrec.pipeline.events.event_spec import EventSpec, load_event_spec
from hybridrec.pipeline.infer_spec import propose_spec

from hybridrec import cli


def histories(users=80, seed=5) -> dict[int, list[int]]:
    """user -> items, oldest first; each user repeats an item once in a while."""
    rng = random.Random(seed)
    out = {}
    for user in range(1, users + 1):
        items = [rng.randint(1, 300) for _ in range(rng.randint(3, 25))]
        if user % 4 == 0:
            items.append(items[0])  # a repeat: an event, not a duplicate row
        out[user] = items
    return out


def write_layout(path, layout: str, users: dict[int, list[int]]) -> None:
    rng = random.Random(9)
    lines = []
    if layout == "pairs":
        lines = [f"{u} {i}" for u, items in users.items() for i in items]
    elif layout == "csv":
        lines = ["user,item"] + [f"u{u},i{i}" for u, items in users.items() for i in items]
    elif layout == "user_per_line":
        lines = [" ".join(map(str, [u, *items])) for u, items in users.items()]
    else:  # MovieLens: a rating and a unix time; a user's rows together, not in time order
        rows = []
        for u, items in users.items():
            time, mine = 978_300_000 + rng.randint(0, 1000), []
            for i in items:
                time += rng.randint(1, 5000)
                mine.append((u, i, rng.randint(1, 5), time))
            rng.shuffle(mine)
            rows += mine
        if layout == "ml1m":
            lines = [f"{u}::{i}::{r}::{t}" for u, i, r, t in rows]
        else:
            lines = ["userId,movieId,rating,timestamp"]
            lines += [f"{u},{i},{r:.1f},{t}" for u, i, r, t in rows]
    path.write_text("\n".join(lines) + "\n")


def preprocessed_items(tmp_path, sample) -> dict[str, list[int]]:
    """Proposes a spec for `sample`, preprocesses it and returns each user's test history
    (the whole history) as item ids, keyed by the raw user id."""
    spec_path, out = tmp_path / "spec.toml", tmp_path / "data"
    assert cli.main(["spec", "--sample", str(sample), "--out", str(spec_path)]) == 0
    command = ["preprocess", "-i", str(sample), "--spec", str(spec_path), "-o", str(out)]
    assert cli.main([*command, "--quiet"]) == 0
    spec = load_event_spec(spec_path)
    table = pa.concat_tables(pq.read_table(path) for path in sorted((out / "test").glob("*.parquet")))  # fmt: skip
    by_user = {row["user"]: row["items"] for row in table.to_pylist()}
    return spec, by_user


def ids(raw: list[str], spec: EventSpec, table: str) -> list[int]:
    hashes = hashing.hash_bytes_list([value.encode() for value in raw])
    return hashing.feature_ids(hashes, np.zeros(len(raw), bool), spec.prefix(table), 8).tolist()


@pytest.mark.parametrize("layout", ["pairs", "csv", "ml1m", "ml20m", "user_per_line"])
def test_each_layout_gives_the_users_histories(tmp_path, layout):
    users = histories()
    sample = tmp_path / {"ml1m": "ratings.dat", "ml20m": "ratings.csv"}.get(layout, "log.txt")
    write_layout(sample, layout, users)
    spec, written = preprocessed_items(tmp_path, sample)
    prefix = "u" if layout == "csv" else ""
    item_prefix = "i" if layout == "csv" else ""
    assert len(written) == len(users)
    for user, items in users.items():
        (user_id,) = ids([f"{prefix}{user}"], spec, "user")
        expected = ids([f"{item_prefix}{i}" for i in items], spec, "item")
        assert written[user_id] == expected, (layout, user)
    if layout == "ml1m":
        assert spec.delimiter == "::" and spec.time and spec.action is not None
    if layout in ("pairs", "csv", "user_per_line"):  # no time: a repeat is an event
        assert not spec.drop_duplicates and not spec.time


def test_a_two_byte_separator_that_splits_no_line_the_same_way(tmp_path, capsys):
    sample = tmp_path / "ratings.dat"
    rng = random.Random(3)
    sample.write_text(
        "".join(f"{u}::{rng.randint(1, 9)}" + "::5" * (u % 3) + "\n" for u in range(60))
    )
    assert cli.main(["spec", "--sample", str(sample)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0
    assert "'::' splits 20 of the 60 sample lines into 2 fields, but line 2 into 3" in error


def test_a_spec_with_a_two_byte_delimiter_rejects_lines_it_does_not_split(tmp_path, capsys):
    sample, spec = tmp_path / "ratings.dat", tmp_path / "spec.toml"
    sample.write_text("1::10::5::978300760\n1::11::4::978300761\n1::12::3::978300762\n2:20:5\n")
    spec.write_text(
        'kind = "events"\nname = "ml"\ndelimiter = "::"\ncolumns = ["u", "i", "r", "t"]\n'
        'user = "u"\nitem = "i"\ntime = "t"\n'
    )
    out = tmp_path / "data"
    assert cli.main(["preprocess", "-i", str(sample), "--spec", str(spec), "-o", str(out), "--quiet"]) == 0  # fmt: skip
    meta = json.loads((out / "metadata.json").read_text())
    (record,) = [
        json.loads(line)
        for name in meta["rejected"]["files"]
        for line in (out / name).read_text().splitlines()
    ]
    assert (record["line"], record["reason"]) == (4, "wrong_field_count")
    with pytest.raises(ValueError, match="one to four bytes"):
        EventSpec(name="x", delimiter=":::::", columns=("u", "i"), user="u", item="i")
    with pytest.raises(UserError, match="'::'"):
        propose_spec(_uneven(tmp_path))


def _uneven(tmp_path):
    path = tmp_path / "uneven.dat"
    path.write_text("1::2\n1::2::3\n4::5::6::7\n" * 5)
    return path
