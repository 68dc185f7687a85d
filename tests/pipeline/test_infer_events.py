"""`hybridrec spec --sample FILE` on event logs: it proposes an event spec, with reasons, that
the event job runs; click logs with a time and id columns stay click logs."""

from __future__ import annotations

import random

from hybridrec.pipeline.events.event_spec import load_event_spec, spec_kind
from hybridrec.pipeline.infer_spec import propose_spec

from hybridrec import cli


def ratings(path, header=True, users=60):
    """MovieLens-like ratings: user, item, unix time, a 1-5 rating."""
    rng = random.Random(1)
    lines = ["user_id,item_id,timestamp,rating"] if header else []
    for user in range(1, users + 1):
        time = 978_300_000 + user * 1000
        for _ in range(rng.randint(3, 40)):
            time += rng.randint(10, 5000)
            lines.append(f"{user},{rng.randint(1, 400)},{time},{rng.randint(1, 5)}")
    path.write_text("\n".join(lines) + "\n")


def test_a_ratings_log_becomes_an_event_spec_that_preprocesses(tmp_path, capsys):
    sample, spec = tmp_path / "ratings.csv", tmp_path / "ratings.toml"
    ratings(sample)
    assert cli.main(["spec", "--sample", str(sample), "--out", str(spec)]) == 0
    printed = capsys.readouterr().out
    assert "user_id    user" in printed and "rating     action" in printed
    assert spec_kind(spec) == "events"
    loaded = load_event_spec(spec)
    assert (loaded.user, loaded.item, loaded.time) == ("user_id", "item_id", "timestamp")
    assert loaded.time_format == "unix"
    assert loaded.action.thresholds == (3.5,) and loaded.action.names == ("negative", "positive")
    out = tmp_path / "data"
    assert (
        cli.main(["preprocess", "-i", str(sample), "--spec", str(spec), "-o", str(out), "--quiet"])
        == 0
    )
    assert "preprocessed" in capsys.readouterr().out
    assert (out / "_SUCCESS").exists() and (out / "test").is_dir()


def test_without_a_header_users_are_the_column_in_runs(tmp_path):
    sample = tmp_path / "ratings.tsv"
    ratings(sample, header=False)
    sample.write_text(sample.read_text().replace(",", "\t"))
    proposed = propose_spec(sample)
    kinds = {guess.name: guess.kind for guess in proposed.columns}
    assert kinds == {"c0": "user", "c1": "item", "c2": "time", "c3": "action"}
    assert proposed.spec.delimiter == "\t" and not proposed.spec.header


def test_user_per_line_is_recognized(tmp_path):
    sample = tmp_path / "Sports.txt"
    sample.write_text("1 2 3 4\n2 5 6\n3 7 8 9 10\n")
    proposed = propose_spec(sample)
    assert proposed.spec.format == "user_per_line"
    assert proposed.spec.delimiter == "whitespace"


def test_a_click_log_with_times_and_ids_stays_a_click_log(tmp_path):
    """A two-valued column (a click label) keeps the click-log proposal unless the user and
    item columns are named so."""
    rng = random.Random(2)
    lines = ["click,hour,site,app,device_type"]
    for row in range(300):
        lines.append(
            f"{rng.randint(0, 1)},{1_700_000_000 + row * 60},s{rng.randint(0, 30)},"
            f"a{rng.randint(0, 40)},{rng.randint(0, 3)}"
        )
    sample = tmp_path / "clicks.csv"
    sample.write_text("\n".join(lines) + "\n")
    proposed = propose_spec(sample)
    assert proposed.spec.label == "click"
