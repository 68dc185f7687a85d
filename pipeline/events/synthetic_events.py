"""Synthetic event logs (what `hybridrec generate --events` writes): users' actions on items.

Two files: the events (`user_id,item_id,timestamp,action,device`, a header, one event a
line, each user's events in time order, users one after another) and the items
(`item_id,category,brand`, one item a line). How the events are made:

- items belong to `topics`; an item's popularity follows a Zipf law over its global rank,
  and within a topic the items form a *series*: after item j of a topic, the next items
  of that topic (j+1, j+2, ...) are likely (episodes, sequels, a shelf);
- each user has interests: a mixture over 1-3 topics, which *drifts*: at every event the
  user may swap one topic for another;
- each event, in order of precedence: a repeat of one of the user's last 20 items (with
  `repeat` probability), the next item of the series of the user's last item (`series`),
  or a popular item of a topic drawn from the interests;
- the action (view, click, like, skip) follows the user's affinity to the item's topic:
  items of the user's topics are liked, others skipped more often;
- timestamps: sessions of events a few minutes apart, sessions hours to days apart, each
  user starting at a random time of `days`;
- history lengths: log-normal around `mean_events` (at least 2), capped at `max_events`.

It is learnable beyond popularity: the series and the interests make the next item
predictable from the history. `oracle_hit_rate` estimates what a model that knew the
generating process would reach (HR@10 of the true next-event distribution's top 10).

Users are made in blocks of `BLOCK_USERS` seeded by (seed, block), so memory is constant
and the output depends only on the arguments.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import time
from pathlib import Path

import numpy as np
from hybridrec.common.progress import Progress

BLOCK_USERS = 2048
VERSION = 2  # of what a given config and seed make (benchmark caches are keyed by it)
ACTIONS = ("view", "click", "like", "skip")
DEVICES = ("mobile", "desktop", "tv")
RECENT = 20  # a repeat picks one of the user's last RECENT items
ITEM_ROWS = 1 << 18  # the items file is written this many rows at a time
SERIES_SPAN = 5  # the series step: 1 to SERIES_SPAN items ahead, nearer ones likelier
START_TIME = 1_700_000_000  # 2023-11-14: the first day


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventLogConfig:
    """What `generate_events` makes."""

    users: int = 10_000
    items: int = 5_000
    topics: int = 50
    mean_events: float = 30.0  # mean events a user (log-normal, at least 2)
    max_events: int = 2_000  # events a user at most
    repeat: float = 0.1  # probability an event repeats one of the user's last 20 items
    series: float = 0.2  # probability it continues the series of the user's last item
    drift: float = 0.02  # probability, each event, that one of the user's topics changes
    zipf: float = 1.0  # popularity exponent over the items' global ranks
    days: int = 60  # span of the users' start times
    seed: int = 0

    def __post_init__(self):
        if self.users < 1 or self.items < self.topics or self.topics < 1:
            raise ValueError("users >= 1 and items >= topics >= 1")
        if not 0 <= self.repeat + self.series <= 1:
            raise ValueError("repeat + series must be a probability")
        if self.mean_events < 2 or self.max_events < 2:
            raise ValueError("mean_events and max_events must be >= 2")


class Catalogue:
    """The items: topic, popularity, place in their topic's series, category and brand."""

    def __init__(self, config: EventLogConfig):
        rng = np.random.default_rng([config.seed, 7])
        n = config.items
        self.topic = rng.integers(0, config.topics, n)
        popularity = (np.arange(n) + 1.0) ** -config.zipf
        self.popularity = popularity[rng.permutation(n)]
        # each topic's items in series order, and where each item sits in it
        self.by_topic = [np.flatnonzero(self.topic == t) for t in range(config.topics)]
        self.place = np.zeros(n, np.int64)
        for members in self.by_topic:
            self.place[members] = np.arange(len(members))
        # per topic: its items' cumulative popularity, to draw a popular item of a topic
        self.cumulative = [np.cumsum(self.popularity[m]) for m in self.by_topic]
        self.category = self.topic // 5  # categories group five topics
        self.brand = rng.integers(0, max(2, n // 25), n)

    def popular_in(self, rng, topics: np.ndarray) -> np.ndarray:
        """One item of each given topic, drawn by popularity."""
        out = np.empty(len(topics), np.int64)
        for topic in np.unique(topics):
            where = np.flatnonzero(topics == topic)
            cumulative = self.cumulative[topic]
            draws = rng.random(len(where)) * cumulative[-1]
            out[where] = self.by_topic[topic][np.searchsorted(cumulative, draws)]
        return out

    def series_next(self, rng, items: np.ndarray) -> np.ndarray:
        """The item 1..SERIES_SPAN places after each item in its topic's series (wrapping)."""
        steps = np.minimum(rng.geometric(0.5, len(items)), SERIES_SPAN)
        out = np.empty(len(items), np.int64)
        topics = self.topic[items]
        for topic in np.unique(topics):
            where = np.flatnonzero(topics == topic)
            members = self.by_topic[topic]
            out[where] = members[(self.place[items[where]] + steps[where]) % len(members)]
        return out


def _interests(rng, users: int, topics: int) -> np.ndarray:
    """[users, 3] topics of each user (some repeated: 1-3 distinct)."""
    return rng.integers(0, topics, (users, 3))


def user_block(config: EventLogConfig, catalogue: Catalogue, block: int) -> dict:
    """The events of users [block * BLOCK_USERS, ...): columns as arrays, users in order and
    each user's events in time order."""
    rng, first, lengths, items, interests = _simulate(config, catalogue, block)
    return _events_of(rng, config, catalogue, first, lengths, items, interests)


def _simulate(config: EventLogConfig, catalogue: Catalogue, block: int):
    """The block's users' item sequences: (rng, first user, lengths, items [users, longest],
    the users' interests after their last event)."""
    rng = np.random.default_rng([config.seed, block])
    first = block * BLOCK_USERS
    users = min(BLOCK_USERS, config.users - first)
    sigma = 1.0
    mu = np.log(config.mean_events) - sigma**2 / 2
    lengths = np.clip(np.round(rng.lognormal(mu, sigma, users)), 2, config.max_events)
    lengths = lengths.astype(np.int64)
    interests = _interests(rng, users, config.topics)
    steps = int(lengths.max())
    items = np.zeros((users, steps), np.int64)
    recent = np.zeros((users, RECENT), np.int64)
    for step in range(steps):
        active = np.flatnonzero(lengths > step)
        n = len(active)
        drift = rng.random(n) < config.drift
        if drift.any():
            who = active[drift]
            interests[who, rng.integers(0, 3, len(who))] = rng.integers(0, config.topics, len(who))
        topics = interests[active, rng.integers(0, 3, n)]
        chosen = catalogue.popular_in(rng, topics)
        if step:
            kind = rng.random(n)
            repeat = (kind < config.repeat) & (step >= 2)
            series = (kind >= config.repeat) & (kind < config.repeat + config.series)
            last = items[active, step - 1]
            if series.any():
                chosen[series] = catalogue.series_next(rng, last[series])
            if repeat.any():
                depth = min(step, RECENT)  # the ring of recent items is full from step 20
                pick = rng.integers(0, depth, int(repeat.sum()))
                chosen[repeat] = recent[active[repeat], pick]
        items[active, step] = chosen
        recent[active, step % RECENT] = chosen
    return rng, first, lengths, items, interests


def oracle_hit_rate(config: EventLogConfig, *, users: int = 4096, k: int = 10) -> float:
    """HR@k of a model that knows how the log was made: for each of the first `users`
    users, the probability that its last event is among the k likeliest items given the
    user's interests and history (the generating distribution, a topic's drift at that
    last event aside). Ranked over every item, the history included: what a model can
    reach at best on the leave-one-out test target."""
    catalogue = Catalogue(config)
    series_steps = np.array([0.5**s for s in range(1, SERIES_SPAN)] + [0.5 ** (SERIES_SPAN - 1)])
    totals = []
    for block in range(-(-min(users, config.users) // BLOCK_USERS)):
        _, _, lengths, items, interests = _simulate(config, catalogue, block)
        for user in range(min(len(lengths), users - block * BLOCK_USERS)):
            n = int(lengths[user])
            step = n - 1  # the last event's step
            probability: dict[int, float] = {}

            def add(item: int, mass: float, probability=probability) -> None:
                probability[item] = probability.get(item, 0.0) + mass

            repeat = config.repeat if step >= 2 else 0.0
            recent = items[user, max(0, step - RECENT) : step]
            for item in recent:
                add(int(item), repeat / len(recent))
            last = int(items[user, step - 1])
            members = catalogue.by_topic[catalogue.topic[last]]
            place = catalogue.place[last]
            for ahead, mass in enumerate(series_steps, 1):
                add(int(members[(place + ahead) % len(members)]), config.series * mass)
            popular = (1.0 - repeat - config.series) / 3
            for topic in interests[user]:
                topic_items = catalogue.by_topic[topic]
                share = catalogue.popularity[topic_items] / catalogue.popularity[topic_items].sum()
                for index in np.argsort(-share)[:k]:
                    add(int(topic_items[index]), popular * share[index])
            totals.append(sum(sorted(probability.values(), reverse=True)[:k]))
    return float(np.mean(totals))


def _events_of(rng, config, catalogue, first, lengths, items, interests) -> dict:
    users = len(lengths)
    user_of = np.repeat(np.arange(users), lengths)
    step = np.arange(len(user_of)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    item = items[user_of, step]
    affinity = (catalogue.topic[item][:, None] == interests[user_of]).any(axis=1)
    # view, click, like, skip: likes follow affinity, skips its absence
    weights = np.where(affinity[:, None], [0.35, 0.3, 0.3, 0.05], [0.4, 0.2, 0.05, 0.35])
    action = (rng.random(len(item))[:, None] > np.cumsum(weights, axis=1)).sum(axis=1)
    # sessions: a few minutes between events, hours to days between sessions
    new_session = rng.random(len(item)) < 0.15
    gaps = np.where(
        new_session, rng.exponential(20 * 3600, len(item)), rng.exponential(240, len(item))
    )
    gaps = gaps.astype(np.int64) + 1
    starts = START_TIME + rng.integers(0, config.days * 86400, users)
    offsets = np.cumsum(gaps) - np.repeat(np.cumsum(gaps)[np.cumsum(lengths) - lengths], lengths)
    times = np.repeat(starts, lengths) + offsets
    return {
        "user": first + user_of,
        "item": item,
        "time": times,
        "action": np.minimum(action, 3),
        "device": rng.integers(0, len(DEVICES), len(item)),
    }


def _lines(columns: dict) -> bytes:
    users = np.char.add("u", columns["user"].astype(str))
    items = np.char.add("i", columns["item"].astype(str))
    times = columns["time"].astype(str)
    actions = np.asarray(ACTIONS)[columns["action"]]
    devices = np.asarray(DEVICES)[columns["device"]]
    rows = [",".join(fields) for fields in zip(users, items, times, actions, devices, strict=True)]
    return ("\n".join(rows) + "\n").encode()


def generate_events(
    events_path: str | Path, items_path: str | Path, config: EventLogConfig, quiet: bool = False
) -> dict:
    """Writes the events and the items (gzip when a name ends in .gz); returns a summary:
    users, events, items, bytes, seconds, paths."""
    started = time.perf_counter()
    catalogue = Catalogue(config)
    blocks = -(-config.users // BLOCK_USERS)
    events = 0
    stream = open(os.devnull, "w") if quiet else None  # noqa: SIM115
    progress = Progress("generate", total=config.users, unit="users", stream=stream)
    with _open(events_path) as handle:
        handle.write(b"user_id,item_id,timestamp,action,device\n")
        for block in range(blocks):
            columns = user_block(config, catalogue, block)
            handle.write(_lines(columns))
            events += len(columns["item"])
            progress.update(min(BLOCK_USERS, config.users - block * BLOCK_USERS), events=events)
    with _open(items_path) as handle:
        handle.write(b"item_id,category,brand\n")
        for start in range(0, config.items, ITEM_ROWS):  # in parts: the rows as text are
            # several times the catalogue's arrays (4.5 GB at 10M items written at once)
            part = slice(start, min(start + ITEM_ROWS, config.items))
            ids = np.char.add("i", np.arange(part.start, part.stop).astype(str))
            categories = np.char.add("c", catalogue.category[part].astype(str))
            brands = np.char.add("b", catalogue.brand[part].astype(str))
            rows = [",".join(f) for f in zip(ids, categories, brands, strict=True)]
            handle.write(("\n".join(rows) + "\n").encode())
    progress.close(events=events)
    return {
        "users": config.users,
        "events": events,
        "items": config.items,
        "bytes": Path(events_path).stat().st_size,
        "seconds": time.perf_counter() - started,
        "events_path": str(events_path),
        "items_path": str(items_path),
    }


def _open(path: str | Path):
    return gzip.open(path, "wb", compresslevel=3) if str(path).endswith(".gz") else open(path, "wb")


def spec_text(items_path: str = "items.csv") -> str:
    """The event spec of what `generate_events` writes (items file relative to the spec)."""
    return generated_spec_text(
        name="synthetic_events",
        columns=("user_id", "item_id", "timestamp", "action", "device"),
        user="user_id",
        action=("action", ACTIONS),
        event_feature="device",
        items=(items_path, ("category", "brand")),
    )


def generated_spec_text(
    *,
    name: str,
    columns: tuple[str, ...],
    user: str,
    action: tuple[str, tuple[str, ...]],
    event_feature: str,
    items: tuple[str, tuple[str, ...]],
) -> str:
    """The event spec of a generated log: a header, unix times in `timestamp`, items in
    `item_id`, the `action` column with its values, one event feature, and the items file
    (its path relative to the spec, its features)."""
    return f"""kind = "events"
name = "{name}"
header = true
columns = {_toml_list(columns)}
user = "{user}"
item = "item_id"
time = "timestamp"
time_format = "unix"
max_length = 200
min_events = 3

[action]
column = "{action[0]}"
values = {_toml_list(action[1])}

[[event_features]]
name = "{event_feature}"

[items]
path = "{items[0]}"
id = "item_id"
features = {_toml_list(items[1])}
"""


def _toml_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f'"{value}"' for value in values) + "]"


def split_by_time(
    events: str | Path, reference: str | Path, stream_paths: list[Path], *, fraction: float
) -> list[int]:
    """Cuts a generated event log (as `generate_events` writes it) in time order: its first
    `fraction` of events into `reference`, the rest in equal parts into `stream_paths`
    (each with the header), as a stream's files would arrive. Returns the events per part
    (the reference's first)."""
    opener = gzip.open if str(events).endswith(".gz") else open
    with opener(events, "rb") as handle:
        data = handle.read()
    lines = data.split(b"\n")
    header, rows = lines[0], [line for line in lines[1:] if line]
    times = np.array([int(row.split(b",")[2]) for row in rows], np.int64)
    rows = [rows[i] for i in np.argsort(times, kind="stable")]
    cut = int(len(rows) * fraction)
    bounds = np.linspace(cut, len(rows), len(stream_paths) + 1).astype(np.int64)
    parts = [(Path(reference), 0, cut)]
    parts += [(Path(p), int(a), int(b)) for p, a, b in zip(stream_paths, bounds[:-1], bounds[1:], strict=True)]  # fmt: skip
    for path, start, stop in parts:
        path.write_bytes(b"\n".join([header, *rows[start:stop]]) + b"\n")
    return [stop - start for _, start, stop in parts]
