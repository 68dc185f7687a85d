"""What the config's "auto" values become for one dataset: a run with no preset and no
`--set` trains a model that fits the data it is given.

Each choice is made once, at the start of a run, from the dataset's metadata (its
feature kinds, row count and per-feature distinct ids); the resolved values are saved in
the run's config.json, so resuming, evaluating and exporting see exactly what trained,
and each choice is printed at start-up with its reason:

| key (auto value)                        | becomes |
|---|---|
| `model.tower` ("auto")                  | DLRM with numeric features; DCN-V2 without (`model.config.choose_tower`) |
| `data.batch_size` (0)                   | a power of two near rows / 200 in [256, 4096] |
| `embedding.dim` (0)                     | a power of two near (distinct ids of the largest feature) ** 0.25, in [8, 128]; a bottom MLP's last width follows it |
| `embedding.optimizer.learning_rate` (0) | Adagrad and row-wise Adagrad 0.05 (accumulators starting at 0, the default), else 0.5 * sqrt(batch / 512); SGD 2 * batch / 512; Adam 0.01 |
| `optimizer.decay` ("auto")              | cosine decay of the dense rate over the run's steps; constant for a followed stream and for a run that stops at its best (`choose_decay`, once the run's length is known) |

The measurements behind the constants are in docs/training.md ("Defaults that fit the data").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hybridrec.common.errors import ConfigError, UserError
from hybridrec.model.config import DenseOptimizerConfig, choose_tower
from hybridrec.pipeline import DatasetMetadata, EventMetadata
from hybridrec.pipeline.events.event_spec import REQUEST_INPUTS, recorded_prefixes
from hybridrec.training.config import TrainConfig

AUTO_STEPS_PER_EPOCH = 200  # data.batch_size = 0 aims at about this many steps per epoch
AUTO_BATCH_RANGE = (256, 4096)  # ... with a power-of-two batch within this range
AUTO_DIM_RANGE = (8, 128)  # embedding.dim = 0 picks a power of two within this range
# embedding.optimizer.learning_rate = 0: the rate at batch 512, the best of those tried on
# the Criteo sample (docs/training.md), and how it scales with the batch for each optimizer
AUTO_SPARSE_RATES_AT_512 = {"adagrad": 0.5, "rowwise_adagrad": 0.5, "sgd": 2.0, "adam": 0.01}
# Adagrad whose accumulators start at 0 (the run default, as FBGEMM's): a row's first step
# is the rate itself whatever the gradient's scale, so the rate does not follow the batch
AUTO_ADAGRAD_RATE_FROM_ZERO = 0.05


def choose_batch_size(batch_size: int, train_rows: int, divisor: int) -> tuple[int, str]:
    """The global batch a run uses and why: `batch_size` itself unless it is 0 (auto), which
    takes the power of two nearest below `train_rows / AUTO_STEPS_PER_EPOCH`, clamped to
    AUTO_BATCH_RANGE (or below `train_rows` when it is smaller) and rounded up to a
    multiple of `divisor` (devices, processes).

    Returns:
        (batch size, one-line reason).
    """
    if batch_size:
        return batch_size, f"data.batch_size = {batch_size} as configured"
    low, high = AUTO_BATCH_RANGE
    target = max(train_rows // AUTO_STEPS_PER_EPOCH, 1)
    chosen = min(max(1 << (target.bit_length() - 1), low), high)
    if 0 < train_rows < chosen:  # fewer rows than the smallest batch: as many as there are
        chosen = 1 << (train_rows.bit_length() - 1)
    chosen = -(-chosen // divisor) * divisor
    if 0 < train_rows < chosen:
        raise ConfigError(
            f"data.batch_size = 0 (auto): the {train_rows:,} training rows are fewer than one "
            f"batch divided over {divisor} devices or processes ({chosen}); train on more rows "
            "or fewer devices"
        )
    return chosen, (
        f"data.batch_size = 0 (auto): {chosen}, about {max(train_rows // chosen, 1)} steps "
        f"per epoch over {train_rows:,} training rows"
    )


def choose_embedding_dim(dim: int, distinct_ids: dict[str, int]) -> tuple[int, str]:
    """The embedding dimension and why: `dim` itself unless it is 0 (auto), which takes the
    power of two nearest to the fourth root of the largest feature's distinct ids (the
    usual rule of thumb for an embedding's width), clamped to AUTO_DIM_RANGE.

    Args:
        dim: the configured `embedding.dim` (0 = auto).
        distinct_ids: feature name -> distinct ids seen in the training split.
    """
    if dim:
        return dim, f"embedding.dim = {dim} as configured"
    low, high = AUTO_DIM_RANGE
    feature, largest = max(distinct_ids.items(), key=lambda item: item[1], default=("", 1))
    chosen = min(max(2 ** round(math.log2(max(largest, 1) ** 0.25)), low), high)
    return chosen, (
        f"embedding.dim = 0 (auto): {chosen}, near the fourth root of the largest feature's "
        f"{largest:,} distinct ids ({feature})"
    )


def choose_sparse_learning_rate(
    rate: float, optimizer: str, batch_size: int, initial_accumulator: float = 0.0
) -> tuple[float, str]:
    """The embedding optimizer's step size and why: `rate` itself unless it is 0 (auto).

    The loss is a mean over the batch, so a row's gradient shrinks as the batch grows: SGD's
    rate grows with the batch, Adagrad's (whose accumulator starts at a constant > 0) with
    its square root; Adam, and Adagrad from a zero accumulator, normalize the gradient's
    scale away.
    """
    if rate:
        return rate, f"embedding.optimizer.learning_rate = {rate:g} as configured"
    if optimizer in ("adagrad", "rowwise_adagrad") and initial_accumulator == 0:
        chosen = AUTO_ADAGRAD_RATE_FROM_ZERO
    else:
        scale = {"adagrad": math.sqrt, "rowwise_adagrad": math.sqrt, "sgd": float, "adam": None}
        chosen = AUTO_SPARSE_RATES_AT_512[optimizer]
        if scale[optimizer]:
            chosen *= scale[optimizer](batch_size / 512)
    chosen = float(f"{chosen:.3g}")
    return chosen, (
        f"embedding.optimizer.learning_rate = 0 (auto): {chosen:g} for {optimizer} at batch "
        f"{batch_size}"
    )


def choose_decay(
    optimizer: DenseOptimizerConfig, last_step: int | None, *, stops_early: bool = False
) -> tuple[DenseOptimizerConfig, str | None]:
    """The dense optimizer with an "auto" decay made concrete for a run ending at `last_step`
    (None: a stream without end), and why; (optimizer, None) when its decay is configured.

    One decay to the end of the run beat a constant rate on the Criteo sample at every batch
    tried (docs/training.md); a stream has no end to decay to, so its rate stays constant,
    and so does the rate of a run that stops at its best (`stops_early`, train.patience):
    its end is not known at the start, and a decay to the cap would stop anywhere on the
    way (on Amazon Toys the constant rate's best validation HR@10 was the cosine's).
    """
    if optimizer.decay != "auto":
        return optimizer, None
    if not last_step or stops_early:
        why = "a followed stream has no last step" if not last_step else "the run stops at its best, not at a known step"  # fmt: skip
        return dataclasses.replace(optimizer, decay="constant"), (
            f"dense learning rate: optimizer.decay = auto: constant {optimizer.learning_rate:g}"
            + (
                f" after {optimizer.warmup_steps:,} steps of warmup"
                if optimizer.warmup_steps
                else ""
            )
            + f" ({why} to decay to)"
        )
    steps = max(last_step - optimizer.warmup_steps, 1)
    final = optimizer.learning_rate * optimizer.final_learning_rate_factor
    return dataclasses.replace(optimizer, decay="cosine", decay_steps=steps), (
        f"dense learning rate: optimizer.decay = auto: cosine from {optimizer.learning_rate:g} "
        f"to {final:g} over the run's {steps:,} steps"
        + (f" after {optimizer.warmup_steps:,} of warmup" if optimizer.warmup_steps else "")
    )


def _with_bottom_mlp_ending(
    config: TrainConfig, tower: str, dim: int, *, only_default: bool = False
) -> TrainConfig:
    """The config with the chosen tower's bottom MLP (if it has one) ending in `dim`;
    with `only_default`, only if the bottom MLP is the tower's default one."""
    sizes = getattr(config.model, tower, None)
    widths = getattr(sizes, "bottom_mlp", None)
    if not widths or widths[-1] == dim:
        return config
    if only_default and widths != type(sizes)().bottom_mlp:
        return config
    sizes = dataclasses.replace(sizes, bottom_mlp=(*widths[:-1], dim))
    return dataclasses.replace(config, model=dataclasses.replace(config.model, **{tower: sizes}))


def resolve_auto(
    config: TrainConfig, metadata: DatasetMetadata, divisor: int
) -> tuple[TrainConfig, tuple[str, ...]]:
    """The config with every "auto" value chosen for `metadata`'s dataset, and one line
    per choice saying what was chosen and why.

    Args:
        config: the run's configuration as loaded.
        metadata: the dataset it trains on.
        divisor: the global batch must divide evenly by this (devices, processes); 1 where
            only the tables matter (an embedding server resolving a trainer's config).
    """
    tower, tower_reason = choose_tower(
        config.model.tower, len(metadata.dense_columns), len(metadata.categorical)
    )
    train_rows = metadata.split_rows(config.data.train_split)
    batch_size, batch_reason = choose_batch_size(config.data.batch_size, train_rows, divisor)
    distinct = {
        name: int(stats.get("distinct_estimate", 1))
        for name, stats in ((metadata.raw.get("stats") or {}).get("categorical") or {}).items()
    }
    dim, dim_reason = choose_embedding_dim(config.embedding.dim, distinct)
    # the rate follows the batch before it is rounded to `divisor`, so that embedding servers,
    # which do not know the trainers' devices, resolve the same tables (`divisor` = 1)
    nominal_batch, _ = choose_batch_size(config.data.batch_size, train_rows, 1)
    optimizer = config.embedding.optimizer
    rate, rate_reason = choose_sparse_learning_rate(
        optimizer.learning_rate, optimizer.name, nominal_batch, optimizer.initial_accumulator
    )
    resolved = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, tower=tower),
        data=dataclasses.replace(config.data, batch_size=batch_size),
        embedding=dataclasses.replace(
            config.embedding,
            dim=dim,
            optimizer=dataclasses.replace(optimizer, learning_rate=rate),
        ),
    )
    # a bottom MLP left at its default follows a configured dim too (an auto dim: any)
    resolved = _with_bottom_mlp_ending(
        resolved, tower, dim, only_default=bool(config.embedding.dim)
    )
    return resolved, (
        f"tower: {tower_reason}",
        f"batch: {batch_reason}",
        f"embedding dim: {dim_reason}",
        f"embedding learning rate: {rate_reason}",
    )


# sequence runs (event-log datasets): the "auto" values
AUTO_SEQUENCE_TOWER = "hstu"
# data.batch_size = 0 (auto): rows of max_length holding the training positions / this many
# (enough steps an epoch for a small dataset: docs/training.md, "The sequence presets")...
AUTO_SEQUENCE_STEPS_PER_EPOCH = 50
# ... within this range of positions a batch (the top times the data-parallel devices: full
# devices for a large dataset)
AUTO_SEQUENCE_TOKENS = (1024, 8192)
# model.sequence.max_length = 0 (auto): the training histories' 99th percentile of length,
# rounded up to a multiple of 8, at most this (the presets' cap, ML-1M's 200)
AUTO_SEQUENCE_MAX_LENGTH = 200
AUTO_TIME_BUCKETS = 64  # HSTU's time-gap bias: half-octave buckets up to 2^32 s
AUTO_SEQUENCE_DIM = 64  # embedding.dim = 0 (SASRec's and HSTU's published widths: 50 to 64)


def resolve_sequence_auto(
    config: TrainConfig, metadata: EventMetadata, divisor: int
) -> tuple[TrainConfig, tuple[str, ...]]:
    """`resolve_auto` for a dataset of user histories: the tower, the rows of a packed
    batch, the embedding dim and rate, and the evaluation split."""
    tower = config.model.tower
    if tower == "auto":
        tower, tower_reason = (
            AUTO_SEQUENCE_TOWER,
            (f"model.tower = 'auto': {AUTO_SEQUENCE_TOWER}, the dataset holds user histories"),
        )
    else:
        tower_reason = f"model.tower = {tower!r} as configured"
    sequence, data = config.model.sequence, config.data
    sequence, length_reason = choose_sequence_length(sequence, metadata)
    if data.token_budget and data.token_budget < sequence.max_length:
        raise UserError(
            f"data.token_budget = {data.token_budget} is smaller than one history row "
            f"(model.sequence.max_length = {sequence.max_length})"
        )
    if data.token_budget:
        rows = data.token_budget // sequence.max_length
        rows_reason = f"data.token_budget = {data.token_budget:,} positions"
    elif data.batch_size:
        rows, rows_reason = data.batch_size, "data.batch_size as configured"
    else:
        rows, rows_reason = choose_sequence_rows(sequence.max_length, metadata, divisor)
    rows = -(-rows // divisor) * divisor
    action_types = (metadata.raw.get("spec") or {}).get("action_types") or []
    if sequence.ranking and not action_types:
        raise UserError(
            f"model.sequence.objective = {sequence.objective!r} ranks the next event's action, "
            f"but {metadata.root} has none (its spec has no [action] table)"
        )
    if sequence.ranking and not sequence.actions:
        sequence = dataclasses.replace(sequence, actions=len(action_types))
    sequence, time_reason = _time_buckets(sequence, tower, metadata)
    sequence, action_reason = _action_inputs(sequence, tower, action_types, metadata)
    side_reason = _side_features(sequence, metadata)
    dim = config.embedding.dim or AUTO_SEQUENCE_DIM
    dim_reason = f"embedding.dim = {dim}" + (
        " as configured" if config.embedding.dim else " (auto)"
    )
    optimizer = config.embedding.optimizer
    rate, rate_reason = choose_sparse_learning_rate(
        optimizer.learning_rate, optimizer.name, rows, optimizer.initial_accumulator
    )
    eval_split, split_reason = data.eval_split, ()
    if eval_split == "eval" and not metadata.has_split("eval") and metadata.has_split("valid"):
        eval_split = "valid"
        split_reason = (
            "evaluation split: 'valid' (the dataset's; test is `hybridrec evaluate --split test`)",
        )
    resolved = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, tower=tower, sequence=sequence),
        data=dataclasses.replace(data, batch_size=rows, eval_split=eval_split),
        embedding=dataclasses.replace(
            config.embedding, dim=dim, optimizer=dataclasses.replace(optimizer, learning_rate=rate)
        ),
    )
    return resolved, (
        f"tower: {tower_reason}",
        *length_reason,
        f"batch: {rows} rows of {sequence.max_length} positions ({rows_reason})",
        f"embedding dim: {dim_reason}",
        f"embedding learning rate: {rate_reason}",
        *time_reason,
        *action_reason,
        *side_reason,
        *split_reason,
    )


def training_positions(metadata: EventMetadata) -> int:
    """Positions an epoch trains: each training history of n events predicts n - 1."""
    lengths = metadata.sequence.get("history_length") or {}
    return int(lengths.get("count", 0) * max(lengths.get("mean", 1.0) - 1.0, 0.0))


def choose_sequence_length(sequence, metadata: EventMetadata) -> tuple[Any, tuple[str, ...]]:
    """`sequence` with `max_length` = 0 (auto) made concrete: the 99th percentile of the
    training histories' lengths rounded up to a multiple of 8, within [8,
    AUTO_SEQUENCE_MAX_LENGTH] (a row that holds 99% of the histories whole; attention's
    cost grows with the square of a row's length); and a start-up line."""
    if sequence.max_length:
        return sequence, ()
    p99 = int((metadata.sequence.get("history_length") or {}).get("p99", AUTO_SEQUENCE_MAX_LENGTH))
    length = min(max(-(-p99 // 8) * 8, 8), AUTO_SEQUENCE_MAX_LENGTH)
    return dataclasses.replace(sequence, max_length=length), (
        f"history length: model.sequence.max_length = 0 (auto): {length}, the training "
        f"histories' 99th percentile ({p99} events) within [8, {AUTO_SEQUENCE_MAX_LENGTH}]",
    )


def choose_sequence_rows(length: int, metadata: EventMetadata, divisor: int) -> tuple[int, str]:
    """The rows of `length` positions an "auto" batch has, and why: the epoch's training
    positions / AUTO_SEQUENCE_STEPS_PER_EPOCH, within AUTO_SEQUENCE_TOKENS (the top times
    `divisor`, the data-parallel devices), rounded to a multiple of `divisor`."""
    low, high = AUTO_SEQUENCE_TOKENS
    positions = training_positions(metadata)
    tokens = min(max(positions // AUTO_SEQUENCE_STEPS_PER_EPOCH, low), high * divisor)
    rows = max(-(-tokens // length), 1)
    rows = -(-rows // divisor) * divisor
    return rows, (
        f"data.batch_size = 0 (auto): about {rows * length:,} positions, {AUTO_SEQUENCE_STEPS_PER_EPOCH} "
        f"steps an epoch of {positions:,} training positions within [{low:,}, {high * divisor:,}]"
    )


def item_table_rows(metadata: EventMetadata, sequence) -> int:
    """The item table's distinct ids: the items', and the side features' it holds too."""
    stats = metadata.raw.get("tables") or {}
    tables = {metadata.side_tables[name] for name in sequence.side_features}
    extra = sum(int((stats.get(table) or {}).get("distinct_estimate", 0)) for table in tables)
    return metadata.distinct_items + extra


def side_prefixes(metadata: EventMetadata, features) -> tuple[int, ...]:
    """The id prefixes of side features' tables (in the item table with the items')."""
    sides, prefixes = metadata.side_tables, recorded_prefixes(metadata.raw["spec"])
    return tuple(dict.fromkeys(prefixes[sides[name]] for name in features))


def check_request_names(sequence, metadata: EventMetadata) -> None:
    """A UserError for an event side feature named like a served request's own input
    (`REQUEST_INPUTS`): a request sends an event feature by its name, so none could send
    it (checked at start-up, and at export for runs trained before)."""
    reserved = [n for n in sequence.side_features if n in metadata.event_features and n in REQUEST_INPUTS]  # fmt: skip
    if reserved:
        raise UserError(
            f"model.sequence.side_features: the event feature {reserved[0]!r} of {metadata.root} "
            "is named as a served request's own input, so a request could not send it; "
            "rename its column in the event spec"
        )


def _side_features(sequence, metadata: EventMetadata) -> tuple[str, ...]:
    """Checks `sequence.side_features` against the dataset's; the start-up line."""
    have = metadata.side_tables
    for name in sequence.side_features:
        if name not in have:
            listed = ", ".join(have) if have else "none (its spec has no [[event_features]] or [items] features)"  # fmt: skip
            raise UserError(
                f"model.sequence.side_features: {name!r} is not a side feature of "
                f"{metadata.root}; it has {listed}"
            )
    check_request_names(sequence, metadata)
    if not sequence.side_features:
        return (f"side features: none (the dataset has {', '.join(have)}: model.sequence.side_features)",) if have else ()  # fmt: skip
    return (f"side features: {', '.join(sequence.side_features)}, added to each event's item row",)  # fmt: skip


def _action_inputs(sequence, tower: str, action_types: list, metadata: EventMetadata):
    """`sequence.action_inputs` resolved (-1, auto: the dataset's action types as inputs
    of SASRec and HSTU)."""
    wanted = sequence.action_inputs
    if wanted > 0 and wanted != len(action_types):
        have = f"{len(action_types)} ({', '.join(action_types)})" if action_types else "none (its spec has no [action] table)"  # fmt: skip
        raise UserError(
            f"model.sequence.action_inputs = {wanted}: {metadata.root} has {have} action types"
        )
    if wanted != -1:
        return sequence, ((f"action inputs: {wanted} types as configured",) if wanted else ())
    builtin = tower in ("sasrec", "hstu")
    count = len(action_types) if builtin else 0
    if count:
        line = f"action inputs: the {count} action types ({', '.join(action_types)}) as inputs"
    else:
        line = "action inputs: none" + (" (the dataset has no action types)" if builtin else "")
    auto = " (model.sequence.action_inputs = -1, auto)"
    return dataclasses.replace(sequence, action_inputs=count), ((line + auto,) if builtin else ())


def _time_buckets(sequence, tower: str, metadata: EventMetadata):
    """`sequence.time_buckets` resolved (-1, auto: HSTU's time-gap bias on a dataset with
    event times)."""
    has_times = bool((metadata.raw.get("spec") or {}).get("time"))
    buckets = sequence.time_buckets
    if buckets > 0 and not has_times:
        raise UserError(
            f"model.sequence.time_buckets = {buckets} biases attention by the time between "
            f"events, but {metadata.root} has no times (its spec has no time column)"
        )
    if buckets != -1:
        return sequence, ((f"time-gap bias: {buckets} buckets as configured",) if buckets else ())
    if tower == "hstu" and has_times:
        buckets, reason = AUTO_TIME_BUCKETS, "HSTU on a dataset with event times"
    else:
        buckets = 0
        reason = "the tower is not HSTU" if tower != "hstu" else "the dataset has no times"
    line = f"time-gap bias: {buckets} buckets (model.sequence.time_buckets = -1, auto: {reason})"
    return dataclasses.replace(sequence, time_buckets=buckets), (line,) if tower == "hstu" else ()


def check_batch_size(name: str, size: int, mesh) -> None:
    """A one-line UserError unless the global batch `size` (config key `name`) splits evenly
    over the mesh's devices and the job's processes."""
    import jax  # imported already by whoever built the mesh; this module stays light without it

    if size % mesh.devices.size or size % jax.process_count():
        raise UserError(
            f"{name} = {size} must divide evenly over {mesh.devices.size} devices and "
            f"{jax.process_count()} processes"
        )
