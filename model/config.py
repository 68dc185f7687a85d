"""Configs of the dense side: tower shape, dense optimizer, device mesh.

All are frozen keyword-only dataclasses read with `common.config.from_dict` /
`common.config.load`; every field says what it does and its unit.

Example (TOML):
    [model]
    tower = "dlrm"
    compute_dtype = "bfloat16"
    [model.dlrm]
    bottom_mlp = [512, 256, 64, 16]
    top_mlp = [512, 256]
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Literal

TowerName = Literal["auto", "dlrm", "dcnv2", "mlp", "dhen", "sasrec", "hstu"]

# the towers that read user histories (event-log datasets), not pooled features
SEQUENCE_TOWERS = ("sasrec", "hstu")

# The interaction modules a DHEN layer can hold (see model/dhen.py).
DHEN_MODULES = ("dot", "cross", "attention", "mlp")

# The mesh axis names; every mesh has DATA_AXIS, MODEL_AXIS is optional.
DATA_AXIS = "data"
MODEL_AXIS = "model"


def _check_widths(name: str, widths: tuple[int, ...], *, allow_empty: bool = False) -> None:
    if not widths and not allow_empty:
        raise ValueError(f"{name} must list at least one layer width")
    if any(width <= 0 for width in widths):
        raise ValueError(f"{name} widths must be positive, got {list(widths)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DLRMConfig:
    """DLRM: bottom MLP over dense features, pairwise dot interaction, top MLP."""

    # widths of the bottom MLP over the dense features; the last must equal the embedding dim
    bottom_mlp: tuple[int, ...] = (512, 256, 64, 16)
    # hidden widths of the top MLP; a 1-unit logit layer always follows ("512-256-1" = [512, 256])
    top_mlp: tuple[int, ...] = (512, 256)
    # also feed each vector's dot product with itself into the top MLP (DLRM's self-interaction)
    self_interaction: bool = False

    def __post_init__(self):
        _check_widths("dlrm.bottom_mlp", self.bottom_mlp)
        _check_widths("dlrm.top_mlp", self.top_mlp, allow_empty=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DCNv2Config:
    """DCN-V2 (Wang et al. 2021): cross layers x0 * (W x + b) + x beside or before a deep MLP."""

    # number of cross layers
    num_cross_layers: int = 3
    # rank r of each cross layer's W = U V^T (d*r*2 weights instead of d*d); 0 = full rank
    low_rank: int = 0
    # "stacked": cross layers then the deep MLP; "parallel": both on the input, concatenated
    structure: Literal["stacked", "parallel"] = "stacked"
    # hidden widths of the deep MLP; a 1-unit logit layer always follows the tower
    deep_mlp: tuple[int, ...] = (512, 256)

    def __post_init__(self):
        if self.num_cross_layers < 0:
            raise ValueError(f"dcnv2.num_cross_layers must be >= 0, got {self.num_cross_layers}")
        if self.low_rank < 0:
            raise ValueError(f"dcnv2.low_rank must be >= 0 (0 = full rank), got {self.low_rank}")
        _check_widths("dcnv2.deep_mlp", self.deep_mlp, allow_empty=True)
        if self.num_cross_layers == 0 and not self.deep_mlp:
            raise ValueError("dcnv2 needs at least one cross layer or one deep_mlp layer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """A plain MLP over [dense features, flattened embeddings] (PERSIA's benchmark tower)."""

    # hidden widths; a 1-unit logit layer always follows
    hidden: tuple[int, ...] = (4096, 2048, 1024, 512, 256)

    def __post_init__(self):
        _check_widths("mlp.hidden", self.hidden)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DHENConfig:
    """DHEN (Zhang et al. 2022): stacked layers, each an ensemble of interaction modules.

    The dense features go through `bottom_mlp` into one more D-vector beside the F
    embeddings; every layer maps the [F+1, D] vectors through each module, concatenates
    the module outputs per vector, projects them back to D, adds the layer input
    (residual) and normalizes; `top_mlp` and a 1-unit logit read the last layer.
    """

    # number of stacked ensemble layers
    num_layers: int = 2
    # the interaction modules of every layer, any of "dot" (pairwise dot products),
    # "cross" (a DCN-V2 cross layer), "attention" (self-attention over the vectors), "mlp"
    modules: tuple[str, ...] = DHEN_MODULES
    # widths of the bottom MLP over the dense features; the last must equal the embedding dim
    bottom_mlp: tuple[int, ...] = (512, 256, 64, 16)
    # hidden widths of the "mlp" module (its output is always the layer's width F' * D)
    module_mlp: tuple[int, ...] = (256,)
    # rank of the "cross" module's W = U V^T; 0 = full rank ((F' * D)^2 weights)
    cross_low_rank: int = 32
    # attention heads of the "attention" module; the embedding dim must divide by it
    attention_heads: int = 2
    # hidden widths of the top MLP; a 1-unit logit layer always follows
    top_mlp: tuple[int, ...] = (512, 256)
    # LayerNorm after each layer's residual sum
    layer_norm: bool = True

    def __post_init__(self):
        if self.num_layers < 1:
            raise ValueError(f"dhen.num_layers must be >= 1, got {self.num_layers}")
        if not self.modules:
            raise ValueError(f"dhen.modules must name at least one of {list(DHEN_MODULES)}")
        unknown = [name for name in self.modules if name not in DHEN_MODULES]
        if unknown:
            raise ValueError(
                f"dhen.modules: unknown module(s) {unknown}; choose from {list(DHEN_MODULES)}"
            )
        if len(set(self.modules)) != len(self.modules):
            raise ValueError(f"dhen.modules names a module twice: {list(self.modules)}")
        _check_widths("dhen.bottom_mlp", self.bottom_mlp)
        _check_widths("dhen.module_mlp", self.module_mlp, allow_empty=True)
        _check_widths("dhen.top_mlp", self.top_mlp, allow_empty=True)
        if self.cross_low_rank < 0:
            raise ValueError(f"dhen.cross_low_rank must be >= 0, got {self.cross_low_rank}")
        if self.attention_heads < 1:
            raise ValueError(f"dhen.attention_heads must be >= 1, got {self.attention_heads}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceConfig:
    """SASRec and HSTU over packed user histories (`model.tower = "sasrec" | "hstu"`).

    Histories are packed into rows of `max_length` positions (several users a row, each
    a segment); every position predicts the next item (docs/training.md, "Sequences").
    """

    # positions per packed row: the longest history the tower reads at once; 0 = auto: the
    # training histories' 99th percentile of length, at most 200 (training.defaults)
    max_length: int = 200
    # a history longer than a row: "split" into consecutive pieces of one row, every event
    # trained once (a piece does not see the one before it), or "truncate" to its most
    # recent max_length events
    long_histories: Literal["split", "truncate"] = "split"
    # attention blocks
    blocks: int = 2
    # attention heads per block
    heads: int = 1
    # width of each head's queries, keys and values; 0 = the embedding dim / heads
    head_dim: int = 0
    # dropout rate on the input embeddings (item rows with their positions)
    dropout: float = 0.2
    # dropout rate inside each block: SASRec after its attention and its FFN, HSTU on the
    # gated attention output before its projection; -1 = the tower's own: SASRec's
    # `dropout`, HSTU's none (on Amazon Toys, HSTU's validation HR@10 fell with it:
    # docs/training.md, "The sequence presets")
    block_dropout: float = -1.0
    # HSTU's relative-position bias: buckets per head, and the distance the last starts at
    # (0 = max_length)
    buckets: int = 32
    max_distance: int = 0
    # HSTU's time-gap bias: buckets per head of the log-scaled seconds between two events
    # (half an octave each: 64 reach 2^32 s); the tower then reads each event's time.
    # -1 = auto: 64 for HSTU on a dataset with times, else 0 (none)
    time_buckets: int = -1
    # each event's action type as an input (a learned embedding a type added to its item's
    # row), SASRec and HSTU: the number of types; -1 = auto: the dataset's, 0 = none
    action_inputs: int = -1
    # side features as inputs (the dataset's event or item feature columns, e.g. device,
    # category, brand): each event's ids of them looked up in the item table (their ids
    # carry their own hash prefix) and added to its item's row
    side_features: tuple[str, ...] = ()
    # what each side feature's row is multiplied by before it is added: a side row is
    # shared by many positions of every batch, and at the item rows' scale it drowns them
    # (docs/training.md, "Side features")
    side_scale: float = 0.1
    # HSTU's attention: "auto" (the Pallas kernel on GPUs, else jax.numpy), "pallas",
    # "reference"
    attention: Literal["auto", "pallas", "reference"] = "auto"
    # the score of an item for a position: "dot" (its row . the position's output) or
    # "cosine" (both L2-normalized), divided by `temperature`
    similarity: Literal["dot", "cosine"] = "dot"
    temperature: float = 1.0
    # retrieval objective: sampled softmax of the next item against this many negatives
    # per batch, shared by every position, with the sampling-probability correction
    negatives: int = 256
    # where negatives come from: "catalogue" (uniformly from the training items), "batch"
    # (the batch's own next items, so by popularity), "mixed" (half each)
    negatives_from: Literal["catalogue", "batch", "mixed"] = "catalogue"
    # each negative's logit corrected by -log(N q), q its sampling probability, so that the
    # sampled softmax estimates the full one (false: the raw logits)
    sampling_correction: bool = True
    # the retrieval loss: "softmax" (the cross-entropy of the next item against the
    # negatives) or "gbce" (gSASRec's generalized binary cross-entropy, the positive's term
    # raised to the power beta calibrated by `gbce_t` and the negatives' share of the catalogue)
    loss: Literal["softmax", "gbce"] = "softmax"
    gbce_t: float = 0.75
    # SASRec's block: "sasrec" (pre-norm attention and a ReLU feed-forward, residuals added)
    # or "ligr" (eSASRec's: pre-norm, each residual gated by a sigmoid of its input, a
    # SwiGLU feed-forward of `ffn_multiplier` x dim)
    block: Literal["sasrec", "ligr"] = "sasrec"
    ffn_multiplier: int = 1
    # "retrieval": the next item by the sampled softmax; "ranking": the next event's action
    # type scored from its item at its position (DLRMv3's form: BCE per action, AUC and NE
    # per action in evaluation; needs a dataset with actions); "both": the two losses summed
    objective: Literal["retrieval", "ranking", "both"] = "retrieval"
    # action types the ranking head scores; 0 = the dataset's (set at start-up)
    actions: int = 0
    # hidden width of the ranking head (an MLP over [output, item row, their product])
    ranking_hidden: int = 256

    def __post_init__(self):
        if self.max_length < 2 and self.max_length != 0:
            raise ValueError(f"sequence.max_length must be >= 2 (0: auto), got {self.max_length}")
        if self.blocks < 1 or self.heads < 1 or self.head_dim < 0:
            raise ValueError("sequence.blocks and heads must be >= 1, head_dim >= 0 (0 = auto)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"sequence.dropout must be within [0, 1), got {self.dropout}")
        if not (0.0 <= self.block_dropout < 1.0 or self.block_dropout == -1.0):
            raise ValueError(
                f"sequence.block_dropout must be within [0, 1) (-1: dropout), got {self.block_dropout}"
            )
        if self.buckets < 1 or self.max_distance < 0:
            raise ValueError("sequence.buckets must be >= 1 and max_distance >= 0")
        if self.action_inputs < -1:
            raise ValueError(f"sequence.action_inputs must be >= 0 (-1: auto), got {self.action_inputs}")  # fmt: skip
        if len(set(self.side_features)) != len(self.side_features):
            raise ValueError(f"sequence.side_features names a feature twice: {list(self.side_features)}")  # fmt: skip
        if not self.side_scale > 0:
            raise ValueError(f"sequence.side_scale must be > 0, got {self.side_scale}")
        if self.time_buckets < -1:
            raise ValueError(
                f"sequence.time_buckets must be >= 0 (-1: auto), got {self.time_buckets}"
            )
        if not self.temperature > 0:
            raise ValueError(f"sequence.temperature must be > 0, got {self.temperature}")
        if self.negatives < 1:
            raise ValueError(f"sequence.negatives must be >= 1, got {self.negatives}")
        if not 0.0 <= self.gbce_t <= 1.0:
            raise ValueError(f"sequence.gbce_t must be within [0, 1], got {self.gbce_t}")
        if self.ffn_multiplier < 1:
            raise ValueError(f"sequence.ffn_multiplier must be >= 1, got {self.ffn_multiplier}")
        if self.actions < 0 or self.ranking_hidden < 1:
            raise ValueError(
                "sequence.actions must be >= 0 (0 = the dataset's), ranking_hidden >= 1"
            )

    def block_rate(self, tower: str) -> float:
        """The dropout rate inside the blocks of `tower` ("sasrec", "hstu")."""
        if self.block_dropout != -1.0:
            return self.block_dropout
        return self.dropout if tower == "sasrec" else 0.0

    @property
    def retrieval(self) -> bool:
        return self.objective in ("retrieval", "both")

    @property
    def ranking(self) -> bool:
        return self.objective in ("ranking", "both")

    @property
    def reads_times(self) -> bool:
        """The tower is called with each position's event time (`times=`)."""
        return self.time_buckets > 0

    @property
    def context(self) -> tuple[str, ...]:
        """What the tower reads of each event besides its item, as keywords: `times`
        (seconds), `actions` (type ids 1..A, 0: none)."""
        return ("times",) * self.reads_times + ("actions",) * (self.action_inputs > 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which dense tower, its sizes, its precision and how its parameters are sharded."""

    # the tower architecture; only the matching sub-table below is used. "auto" picks one
    # from the data (see `choose_tower`): DLRM with numeric features, DCN-V2 without (HSTU
    # on user histories). A user's own tower: "package.module:ClassName" (model/custom.py)
    tower: str = "auto"
    # a user's tower's keyword arguments (with tower = "package.module:ClassName")
    tower_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    # DLRM sizes (used when tower = "dlrm")
    dlrm: DLRMConfig = dataclasses.field(default_factory=DLRMConfig)
    # DCN-V2 sizes (used when tower = "dcnv2")
    dcnv2: DCNv2Config = dataclasses.field(default_factory=DCNv2Config)
    # plain MLP sizes (used when tower = "mlp")
    mlp: MLPConfig = dataclasses.field(default_factory=MLPConfig)
    # DHEN sizes and module set (used when tower = "dhen")
    dhen: DHENConfig = dataclasses.field(default_factory=DHENConfig)
    # SASRec / HSTU sizes and the retrieval objective (tower = "sasrec" or "hstu")
    sequence: SequenceConfig = dataclasses.field(default_factory=SequenceConfig)
    # Disaggregated Multi-Tower: groups of categorical feature positions (0-based, in the
    # dataset's feature order), each interacted and compressed by its own Tower Module
    # before the global tower above; every feature in exactly one group. [] = no towers
    towers: tuple[tuple[int, ...], ...] = ()
    # vectors (of the embedding dim) each Tower Module compresses its group into
    tower_outputs: int = 2
    # hidden widths of each Tower Module's MLP
    tower_mlp: tuple[int, ...] = (128,)
    # where the towers run: "flat" (every device runs the whole model on its rows) or
    # "towers" (each Tower Module on its own devices, only its compressed outputs exchanged;
    # needs `towers`, docs/models.md "DMT placement"). Same parameters either way
    layout: Literal["flat", "towers"] = "flat"
    # dtype of activations and matmuls; parameters and optimizer state are always float32
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    # logical axis name used by the layers -> mesh axis; names missing here or mapped to an
    # axis the mesh lacks are replicated ("mlp": hidden MLP widths, "cross": DCN cross width)
    partition_rules: tuple[tuple[str, str], ...] = (("mlp", "model"), ("cross", "model"))
    # a parameter dimension is sharded over its mesh axis only if it has at least this many
    # entries and divides evenly by the axis size (so only the widest layers are split)
    min_sharded_width: int = 1024

    def __post_init__(self):
        if self.tower not in typing.get_args(TowerName) and ":" not in self.tower:
            raise ValueError(
                f"tower must be one of {list(typing.get_args(TowerName))} or a user's tower "
                f"'package.module:ClassName', got {self.tower!r}"
            )
        if self.tower_config and ":" not in self.tower:
            raise ValueError(
                "tower_config is for a user's tower (tower = 'package.module:ClassName')"
            )
        if self.min_sharded_width < 1:
            raise ValueError(f"min_sharded_width must be >= 1, got {self.min_sharded_width}")
        if any(not tower for tower in self.towers):
            raise ValueError("towers: every tower must list at least one feature position")
        seen = [index for tower in self.towers for index in tower]
        repeated = sorted({index for index in seen if seen.count(index) > 1})
        if repeated:
            raise ValueError(f"towers: feature position(s) {repeated} are in several towers")
        if any(index < 0 for index in seen):
            raise ValueError(f"towers: feature positions must be >= 0, got {sorted(seen)[0]}")
        if self.tower_outputs < 1:
            raise ValueError(f"tower_outputs must be >= 1, got {self.tower_outputs}")
        if self.layout == "towers" and not self.towers:
            raise ValueError("layout = 'towers' needs towers (the feature groups of DMT)")
        _check_widths("tower_mlp", self.tower_mlp, allow_empty=True)
        names = [name for name, _ in self.partition_rules]
        if len(set(names)) != len(names):
            raise ValueError(f"partition_rules name a logical axis twice: {names}")


def choose_tower(tower: str, num_dense: int, num_categorical: int) -> tuple[str, str]:
    """The tower a run uses and why: `tower` itself unless it is "auto", which picks DLRM
    when the data has numeric (dense) features (its bottom MLP needs them) and DCN-V2
    when it has none (its cross layers model feature interactions from embeddings alone).

    Returns:
        (tower name, one-line reason).
    """
    if tower != "auto":
        return tower, f"model.tower = {tower!r} as configured"
    if num_dense:
        return "dlrm", (
            f"model.tower = 'auto': dlrm, the data has {num_dense} numeric feature(s) "
            f"for its bottom MLP and {num_categorical} categorical"
        )
    return "dcnv2", (
        f"model.tower = 'auto': dcnv2, the data has no numeric features (DLRM's bottom MLP "
        f"needs some), only {num_categorical} categorical"
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseOptimizerConfig:
    """Optax optimizer and learning-rate schedule for the dense parameters."""

    # optimizer: "sgd" (with optional momentum), "adagrad", "adam", or "shampoo" (blocked
    # Shampoo grafted onto Adam or AdaGrad, model/shampoo.py)
    name: Literal["sgd", "adagrad", "adam", "shampoo"] = "adam"
    # peak learning rate, reached at the end of warmup (per step, unitless)
    learning_rate: float = 1e-3
    # steps of linear warmup from 0 to learning_rate
    warmup_steps: int = 0
    # schedule after warmup: "constant", or "cosine"/"linear" decay over decay_steps; "auto":
    # cosine to final_learning_rate_factor over the run's steps after warmup when the run has
    # a last step (`hybridrec train`: data.max_steps or data.epochs), constant for a followed
    # stream (test AUC +0.002 on the Criteo sample at batch 128 and 512: docs/training.md)
    decay: Literal["auto", "constant", "cosine", "linear"] = "auto"
    # steps of decay after warmup (required > 0 for "cosine" and "linear")
    decay_steps: int = 0
    # learning rate at the end of decay as a fraction of learning_rate
    final_learning_rate_factor: float = 0.0
    # sgd momentum (0 = plain sgd)
    momentum: float = 0.0
    # adam first-moment decay
    beta1: float = 0.9
    # adam second-moment decay
    beta2: float = 0.999
    # adam/adagrad epsilon added to the denominator
    epsilon: float = 1e-8
    # adagrad initial accumulator value
    initial_accumulator: float = 0.1
    # clip the dense gradient to this global L2 norm before the update; 0 = no clipping
    gradient_clip_norm: float = 0.0
    # adam: decoupled weight decay of the dense parameters (AdamW), times the learning rate
    # each step; 0 = none
    weight_decay: float = 0.0
    # shampoo: largest rows/cols of one preconditioner block (matrices are cut into blocks)
    shampoo_block_size: int = 128
    # shampoo: steps between recomputations of the preconditioners' inverse 4th roots;
    # the first this-many steps use the grafting method alone
    shampoo_precondition_every: int = 10
    # shampoo: the diagonal method whose per-block step size the Shampoo direction takes
    shampoo_grafting: Literal["adam", "adagrad"] = "adam"
    # shampoo: added to each statistics block before the inverse root, relative to its
    # largest eigenvalue (at least 1e-7: float32)
    shampoo_epsilon: float = 1e-6

    def __post_init__(self):
        if not self.learning_rate > 0 or not math.isfinite(self.learning_rate):
            raise ValueError(f"learning_rate must be a positive number, got {self.learning_rate}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay in ("cosine", "linear") and self.decay_steps <= 0:
            raise ValueError(f"decay = {self.decay!r} needs decay_steps > 0")
        if not 0.0 <= self.final_learning_rate_factor <= 1.0:
            raise ValueError("final_learning_rate_factor must be within [0, 1]")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be within [0, 1), got {self.momentum}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be within [0, 1)")
        if self.epsilon <= 0 or self.initial_accumulator < 0 or self.gradient_clip_norm < 0:
            raise ValueError("epsilon must be > 0; initial_accumulator, gradient_clip_norm >= 0")
        if self.weight_decay < 0 or (self.weight_decay and self.name != "adam"):
            raise ValueError(
                f"optimizer.weight_decay must be >= 0 and is adam's (AdamW), got "
                f"{self.weight_decay} for {self.name}"
            )
        if self.shampoo_block_size < 1 or self.shampoo_precondition_every < 1:
            raise ValueError(
                "shampoo_block_size and shampoo_precondition_every must be >= 1, got "
                f"{self.shampoo_block_size} and {self.shampoo_precondition_every}"
            )
        if not 1e-7 <= self.shampoo_epsilon < 1:
            raise ValueError(
                f"shampoo_epsilon must be within [1e-7, 1), got {self.shampoo_epsilon} (below "
                "1e-7 of the largest eigenvalue, float32 statistics cannot be inverted)"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The device mesh of the dense step: a data axis and an optional model axis."""

    # devices per axis; -1 on one axis = all remaining devices (e.g. [-1] or [-1, 2])
    shape: tuple[int, ...] = (-1,)
    # axis names, ["data"] or ["data", "model"]
    axis_names: tuple[str, ...] = (DATA_AXIS,)

    def __post_init__(self):
        if len(self.shape) != len(self.axis_names):
            raise ValueError(
                f"mesh shape {list(self.shape)} and axis_names {list(self.axis_names)} differ in length"
            )
        if self.axis_names not in ((DATA_AXIS,), (DATA_AXIS, MODEL_AXIS)):
            raise ValueError(
                f"mesh axis_names must be [{DATA_AXIS!r}] or [{DATA_AXIS!r}, {MODEL_AXIS!r}], "
                f"got {list(self.axis_names)}"
            )
        if any(size == 0 or size < -1 for size in self.shape) or list(self.shape).count(-1) > 1:
            raise ValueError(
                f"mesh shape entries must be positive, with at most one -1, got {list(self.shape)}"
            )
