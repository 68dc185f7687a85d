"""A synthetic music-streaming log shaped like Yambda (`hybridrec generate --events
--profile yambda`): what MLPerf's DLRMv4 benchmark trains on, at any size.

Yambda (Yandex Music, 2025) holds users' events on tracks: listens with the share of the
track played, likes, dislikes, unlikes and undislikes, each organic or prompted by a
recommendation; tracks belong to albums and artists. Two files and a spec:

- `events.csv`: `uid,item_id,timestamp,is_organic,event_type,played_ratio_pct` (one event a
  line, each user's events in time order, users one after another; `played_ratio_pct`
  empty but for listens), as Yambda's `multi_event` table;
- `tracks.csv`: `item_id,artist_id,album_id`;
- `events.toml`: the event spec that preprocesses them into histories (the event type as
  the action, `is_organic` as an event feature, artist and album as item features).

How the events are made, so that what a model can learn is known:

- artists have a Zipf popularity; an artist's tracks (more for popular artists) come in
  albums of `ALBUM_TRACKS`; within an artist, earlier tracks are more popular;
- each user has a taste vector and a bias; each artist a vector; a user's *affinity* to an
  artist is their product, plus the bias, plus a component of that user and artist alone
  (a hash of both: what a user x artist table can learn and no factorization can);
- an organic event picks an artist among the user's favourites (candidates drawn by
  popularity, weighted by affinity), then one of its tracks; a recommended one picks a
  track by global popularity;
- a listen plays the share sigmoid(1.7 (z + e)) of the track, z = affinity + 0.4 if organic
  - 0.3, e ~ N(0, 1): `listen_plus` (played >= 50%, DLRMv4's label) has probability
  Phi(z). `oracle_auc` is the AUC of that probability on the listens generated: what a
  model that knew the process would reach;
- one event in `REACTIONS` is a reaction instead: a like with probability sigmoid(2 z),
  else a dislike; a tenth of them are taken back (unlike, undislike);
- times: each user's events uniformly over the `days`, from a start in their first fifth.

Users are made in blocks seeded by (seed, block) of at most `BLOCK_EVENTS` expected events,
so memory is bounded in events and the output depends only on the arguments.
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
from hybridrec.common.progress import Progress
from hybridrec.pipeline.events.synthetic_events import generated_spec_text
from scipy.special import ndtr

EVENT_TYPES = ("listen", "like", "dislike", "unlike", "undislike")
ALBUM_TRACKS = 10  # tracks an album
CANDIDATES = 32  # artists drawn by popularity for a user's favourites
REACTIONS = 0.08  # share of events that are likes, dislikes and their reversals
BLOCK_EVENTS = 1 << 21  # expected events a block of users
START_TIME = 1_700_000_000
TRACK_ROWS = 1 << 20  # the tracks file is written this many rows at a time
BINS = 4096  # of the true probability, for oracle_auc


@dataclasses.dataclass(frozen=True, kw_only=True)
class YambdaConfig:
    """What `generate_yambda` makes."""

    users: int = 10_000
    tracks: int = 100_000
    artists: int = 0  # 0: tracks // 10
    mean_events: float = 200.0  # events a user over the days (log-normal, at least 2)
    max_events: int = 50_000
    days: int = 30
    organic: float = 0.5  # share of organic events
    dims: int = 16  # of the taste vectors
    seed: int = 0

    def __post_init__(self):
        if self.users < 1 or self.tracks < 1 or self.days < 1:
            raise ValueError("users, tracks and days must be >= 1")
        if self.artists < 0 or self.artists > self.tracks:
            raise ValueError("artists must be within [0, tracks] (0: tracks // 10)")
        if self.mean_events < 2 or self.max_events < 2:
            raise ValueError("mean_events and max_events must be >= 2")
        if not 0 <= self.organic <= 1:
            raise ValueError("organic is a share, within [0, 1]")

    @property
    def artist_count(self) -> int:
        return self.artists or max(1, self.tracks // 10)

    @property
    def block_users(self) -> int:
        return max(1, min(4096, int(BLOCK_EVENTS // self.mean_events)))


class Tracks:
    """Artists (popularity, taste vectors) and their tracks and albums."""

    def __init__(self, config: YambdaConfig):
        rng = np.random.default_rng([config.seed, 11])
        artists, tracks = config.artist_count, config.tracks
        weight = 1.0 / (np.arange(artists) + 1.0) ** 0.9
        self.artist_p = weight / weight.sum()
        spread = np.sqrt(weight) / np.sqrt(weight).sum()
        self.count = 1 + rng.multinomial(tracks - artists, spread).astype(np.int64)
        self.first = np.cumsum(self.count) - self.count
        self.artist_of = np.repeat(np.arange(artists, dtype=np.int32), self.count)
        albums = -(-self.count // ALBUM_TRACKS)
        index = np.arange(tracks) - self.first[self.artist_of]
        self.album_of = (np.cumsum(albums) - albums)[self.artist_of] + index // ALBUM_TRACKS
        scale = 1.0 / math.sqrt(config.dims)
        self.vectors = (rng.standard_normal((artists, config.dims)) * scale).astype(np.float32)
        self._cumulative = np.cumsum(self.artist_p)

    def popular_artists(self, rng, n: int) -> np.ndarray:
        at = np.searchsorted(self._cumulative, rng.random(n) * self._cumulative[-1])
        return np.minimum(at, len(self.count) - 1)

    def track_of(self, rng, artists: np.ndarray) -> np.ndarray:
        """A track of each artist, the earlier ones likelier."""
        within = (self.count[artists] * rng.random(len(artists)) ** 2).astype(np.int64)
        return self.first[artists] + within


def _mixed(seed: int, users: np.ndarray, artists: np.ndarray) -> np.ndarray:
    """N(0, 1)-like values that depend on (seed, user, artist) alone (splitmix64 finalizer,
    the sum of four uniforms, rescaled)."""
    with np.errstate(over="ignore"):
        x = users.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x ^= artists.astype(np.uint64) * np.uint64(0xD1B54A32D192ED03) + np.uint64(seed + 1)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    parts = [(x >> np.uint64(16 * k)) & np.uint64(0xFFFF) for k in range(4)]
    total = sum(part.astype(np.float64) for part in parts) / 65535.0
    return ((total - 2.0) / math.sqrt(4 / 12)).astype(np.float32)


def _phi(z: np.ndarray) -> np.ndarray:
    """The standard normal CDF."""
    return ndtr(z)


def user_block(config: YambdaConfig, tracks: Tracks, block: int) -> dict:
    """The events of users [block * block_users, ...): columns as arrays, users in order and
    each user's events in time order, with each listen's true listen_plus probability."""
    rng = np.random.default_rng([config.seed, 1000 + block])
    first = block * config.block_users
    users = min(config.block_users, config.users - first)
    sigma = 1.0
    mu = np.log(config.mean_events) - sigma**2 / 2
    lengths = np.clip(np.round(rng.lognormal(mu, sigma, users)), 2, config.max_events)
    lengths = lengths.astype(np.int64)
    taste = rng.standard_normal((users, config.dims)).astype(np.float32) / math.sqrt(config.dims)
    bias = rng.normal(0.0, 0.3, users).astype(np.float32)
    uid = first + np.arange(users)

    def affinity(who: np.ndarray, artists: np.ndarray) -> np.ndarray:
        shared = np.einsum("nd,nd->n", taste[who], tracks.vectors[artists])
        return 1.5 * shared + bias[who] + 0.6 * _mixed(config.seed, uid[who], artists)

    # favourites: candidates by popularity, weighted by affinity (a cumulative row a user)
    candidates = tracks.popular_artists(rng, users * CANDIDATES).reshape(users, CANDIDATES)
    owners = np.repeat(np.arange(users), CANDIDATES)
    weights = np.exp(2.0 * affinity(owners, candidates.ravel())).reshape(users, CANDIDATES)
    cumulative = np.cumsum(weights / weights.sum(axis=1, keepdims=True), axis=1)

    user_of = np.repeat(np.arange(users), lengths)
    n = len(user_of)
    organic = rng.random(n) < config.organic
    artist = np.empty(n, np.int64)
    pick = (rng.random(n)[:, None] > cumulative[user_of]).sum(axis=1)
    artist[organic] = candidates[user_of[organic], np.minimum(pick[organic], CANDIDATES - 1)]
    track = np.empty(n, np.int64)
    track[organic] = tracks.track_of(rng, artist[organic])
    recommended = ~organic
    popular = tracks.popular_artists(rng, int(recommended.sum()))
    track[recommended] = tracks.track_of(rng, popular)
    artist[recommended] = popular
    z = affinity(user_of, artist) + 0.4 * organic - 0.3
    # the event type: a listen, or a reaction (like by affinity, else dislike; some undone)
    reaction = rng.random(n) < REACTIONS
    liked = rng.random(n) < 1.0 / (1.0 + np.exp(-2.0 * z))
    undone = rng.random(n) < 0.1
    kind = np.where(liked, np.where(undone, 3, 1), np.where(undone, 4, 2))
    kind = np.where(reaction, kind, 0)
    played = 1.0 / (1.0 + np.exp(-1.7 * (z + rng.standard_normal(n))))
    # times: uniform over the days from a start in the first fifth, in order per user
    span = config.days * 86400
    start = rng.integers(0, max(span // 5, 1), users)
    offsets = start[user_of] + rng.random(n) * (span - start[user_of])
    order = np.lexsort((offsets, user_of))
    return {
        "uid": uid[user_of],
        "item_id": track[order],
        "timestamp": START_TIME + offsets[order].astype(np.int64),
        "is_organic": organic[order].astype(np.int8),
        "event_type": kind[order].astype(np.int8),
        "played_ratio_pct": np.floor(100 * played[order]).astype(np.int16),
        "p_listen_plus": _phi(z[order]),
    }


def _table(columns: dict) -> pa.Table:
    """The block's rows as the events file's columns (a listen's played share, else null)."""
    listen = columns["event_type"] == 0
    return pa.table(
        {
            "uid": columns["uid"],
            "item_id": columns["item_id"],
            "timestamp": columns["timestamp"],
            "is_organic": columns["is_organic"],
            "event_type": pa.DictionaryArray.from_arrays(
                columns["event_type"], pa.array(EVENT_TYPES)
            ).cast(pa.string()),
            "played_ratio_pct": pa.array(columns["played_ratio_pct"], mask=~listen),
        }
    )


def _auc(positive: np.ndarray, negative: np.ndarray) -> float:
    """AUC from histograms of a score over the same bins (ties count a half)."""
    below = np.cumsum(negative) - negative
    pairs = positive.sum() * negative.sum()
    return float((positive * (below + 0.5 * negative)).sum() / pairs) if pairs else math.nan


def _open(path: Path):
    return gzip.open(path, "wb", compresslevel=3) if path.suffix == ".gz" else open(path, "wb")


def generate_yambda(
    events_path: str | Path,
    tracks_path: str | Path,
    config: YambdaConfig,
    *,
    progress: bool = True,
) -> dict:
    """Writes the events and the tracks (see the module); returns a summary: events, users,
    tracks, artists, albums, listens, listen_plus_rate, organic_rate, oracle_auc, bytes,
    seconds."""
    started = time.perf_counter()
    tracks = Tracks(config)
    events_path, tracks_path = Path(events_path), Path(tracks_path)
    with open(tracks_path, "wb") as handle:
        handle.write(b"item_id,artist_id,album_id\n")
        for at in range(0, config.tracks, TRACK_ROWS):
            rows = np.arange(at, min(at + TRACK_ROWS, config.tracks))
            fields = (rows.astype(str), tracks.artist_of[rows].astype(str), tracks.album_of[rows].astype(str))  # fmt: skip
            handle.write(("\n".join(map(",".join, zip(*fields, strict=True))) + "\n").encode())
    blocks = -(-config.users // config.block_users)
    expected = int(config.users * config.mean_events)
    meter = Progress("generate", total=expected, unit="events") if progress else None
    totals = {"events": 0, "listens": 0, "listen_plus": 0, "organic": 0}
    positive, negative = np.zeros(BINS), np.zeros(BINS)
    with _open(events_path) as handle:
        handle.write(b"uid,item_id,timestamp,is_organic,event_type,played_ratio_pct\n")
        options = pacsv.WriteOptions(include_header=False, quoting_style="none")
        for block in range(blocks):
            columns = user_block(config, tracks, block)
            pacsv.write_csv(_table(columns), handle, options)
            listen = columns["event_type"] == 0
            label = columns["played_ratio_pct"][listen] >= 50
            bins = np.minimum((columns["p_listen_plus"][listen] * BINS).astype(np.int64), BINS - 1)
            positive += np.bincount(bins[label], minlength=BINS)
            negative += np.bincount(bins[~label], minlength=BINS)
            totals["events"] += len(listen)
            totals["listens"] += int(listen.sum())
            totals["listen_plus"] += int(label.sum())
            totals["organic"] += int(columns["is_organic"].sum())
            if meter:
                meter.update(len(listen))
    if meter:
        meter.close()
    return {
        "events": totals["events"],
        "users": config.users,
        "tracks": config.tracks,
        "artists": config.artist_count,
        "albums": int(tracks.album_of[-1]) + 1,
        "listens": totals["listens"],
        "listen_plus_rate": totals["listen_plus"] / max(totals["listens"], 1),
        "organic_rate": totals["organic"] / max(totals["events"], 1),
        "oracle_auc": _auc(positive, negative),
        "bytes": events_path.stat().st_size + tracks_path.stat().st_size,
        "seconds": time.perf_counter() - started,
    }


def yambda_spec_text(tracks_path: str = "tracks.csv") -> str:
    """The event spec of what `generate_yambda` writes (tracks file relative to the spec)."""
    return generated_spec_text(
        name="synthetic_yambda",
        columns=("uid", "item_id", "timestamp", "is_organic", "event_type", "played_ratio_pct"),
        user="uid",
        action=("event_type", EVENT_TYPES),
        event_feature="is_organic",
        items=(tracks_path, ("artist_id", "album_id")),
    )
