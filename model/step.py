"""The synchronous dense step: state, optimizer, `train_step` / `eval_step` jitted over a mesh.

`train_step(state, batch) -> (state, metrics, embedding_grads)` is a pure function of
device arrays. `make_train_step` jits it once with explicit input and output
shardings and donates the state buffers, so every call reuses one executable and
updates the parameters in place. The dense gradient is a mean over the *global*
batch, so XLA inserts the cross-device reduction: every device of every process
applies the same update (synchronous data parallelism).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from hybridrec.common.errors import UserError
from hybridrec.model import shampoo as shampoo_lib
from hybridrec.model import sharding as sharding_lib
from hybridrec.model.config import DenseOptimizerConfig, ModelConfig
from hybridrec.model.towers import build_tower
from jax.sharding import Mesh, NamedSharding

P = jax.sharding.PartitionSpec


class NonFiniteLossError(UserError):
    """The loss or the dense gradient became NaN/inf (usually a too large learning rate)."""


@struct.dataclass
class TrainState:
    """Everything the dense step updates; a pytree of (sharded) arrays.

    The array fields are what a checkpoint saves; `graphdef` (the tower's structure)
    and `optimizer_config` are static, compared by value, and rebuilt from the configs.
    """

    step: jax.Array  # int32 [], number of updates applied
    params: dict[str, Any]  # the tower's parameters as a nested dict of f32 arrays
    opt_state: optax.OptState  # optax state, laid out like `params` where it mirrors them
    graphdef: nnx.GraphDef = struct.field(pytree_node=False)
    optimizer_config: DenseOptimizerConfig = struct.field(pytree_node=False)
    # embedding tables held on the devices (`model.device_tables`): name -> values, state;
    # not part of a dense checkpoint (their rows are saved with the store's)
    tables: dict[str, Any] = struct.field(default_factory=dict)

    @property
    def tx(self) -> optax.GradientTransformation:
        return make_optimizer(self.optimizer_config)[0]

    @property
    def schedule(self) -> optax.Schedule:
        return make_optimizer(self.optimizer_config)[1]

    def learning_rate(self, step: int) -> float:
        """The dense learning rate after `step` updates, read on the host (the schedule
        jitted: its ops one by one cost ~0.2 ms a call, ~1 ms on a busy host)."""
        return float(_jitted_schedule(self.optimizer_config)(step))


def make_schedule(config: DenseOptimizerConfig) -> optax.Schedule:
    """Linear warmup to `learning_rate` over `warmup_steps`, then constant/cosine/linear decay
    ("auto" is made cosine over a run's steps by the trainer, `training.defaults.choose_decay`;
    left unresolved, where no run length is known, it is constant)."""
    peak = config.learning_rate
    end = peak * config.final_learning_rate_factor
    if config.decay == "cosine":
        decay = optax.cosine_decay_schedule(
            peak, config.decay_steps, alpha=config.final_learning_rate_factor
        )
    elif config.decay == "linear":
        decay = optax.linear_schedule(peak, end, config.decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    warmup = config.warmup_steps
    if warmup == 0:
        return decay

    def schedule(count):
        count = jnp.asarray(count)
        # (count + 1) / warmup: the first update already moves, the last warmup step hits peak
        warm = peak * jnp.minimum(1.0, (count + 1) / warmup)
        return jnp.where(count < warmup, warm, decay(jnp.maximum(count - warmup, 0)))

    return schedule


@functools.cache
def _jitted_schedule(config: DenseOptimizerConfig) -> Callable[[int], jax.Array]:
    return jax.jit(make_optimizer(config)[1])


@functools.cache
def make_optimizer(
    config: DenseOptimizerConfig,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax transformation for the dense parameters and its learning-rate schedule."""
    schedule = make_schedule(config)
    if config.name == "sgd":
        optimizer = optax.sgd(schedule, momentum=config.momentum or None)
    elif config.name == "adagrad":
        optimizer = optax.adagrad(
            schedule, initial_accumulator_value=config.initial_accumulator, eps=config.epsilon
        )
    elif config.name == "shampoo":
        optimizer = shampoo_lib.shampoo(
            schedule,
            block_size=config.shampoo_block_size,
            precondition_every=config.shampoo_precondition_every,
            grafting=config.shampoo_grafting,
            beta1=config.beta1,
            beta2=config.beta2,
            epsilon=config.epsilon,
            matrix_epsilon=config.shampoo_epsilon,
        )
    else:  # AdamW with a weight decay; plain Adam (its own optimizer state) without
        adam = (
            functools.partial(optax.adamw, weight_decay=config.weight_decay)
            if config.weight_decay
            else optax.adam
        )
        optimizer = adam(schedule, b1=config.beta1, b2=config.beta2, eps=config.epsilon)
    if config.gradient_clip_norm > 0:
        optimizer = optax.chain(optax.clip_by_global_norm(config.gradient_clip_norm), optimizer)
    return optimizer, schedule


def _abstract_tower(
    model_config: ModelConfig, dims: Mapping[str, int]
) -> tuple[nnx.GraphDef, nnx.State]:
    tower = nnx.eval_shape(lambda: build_tower(model_config, **dims, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(tower, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError("towers must only hold nnx.Param state")
    return graphdef, params


def _init_fn(
    model_config: ModelConfig, optimizer_config: DenseOptimizerConfig, dims: Mapping[str, int]
):
    tx, _ = make_optimizer(optimizer_config)

    def init(rng: jax.Array) -> TrainState:
        tower = build_tower(model_config, **dims, rngs=nnx.Rngs(params=rng))
        graphdef, params = nnx.split(tower, nnx.Param)
        params = nnx.to_pure_dict(params)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            graphdef=graphdef,
            optimizer_config=optimizer_config,
        )

    return init


def abstract_train_state(
    model_config: ModelConfig,
    optimizer_config: DenseOptimizerConfig,
    mesh: Mesh,
    *,
    num_dense: int,
    num_features: int,
    embedding_dim: int,
) -> TrainState:
    """The state's shapes, dtypes and target shardings, without allocating anything.

    Leaves are `jax.ShapeDtypeStruct`s carrying their `NamedSharding`, ready to be a
    restore target (Orbax) or the `out_shardings` of the initializer.
    """
    dims = {"num_dense": num_dense, "num_features": num_features, "embedding_dim": embedding_dim}
    init = _init_fn(model_config, optimizer_config, dims)
    abstract = jax.eval_shape(init, jax.random.key(0))
    _, abstract_params = _abstract_tower(model_config, dims)
    param_specs = sharding_lib.param_specs(abstract_params, model_config, mesh)
    opt_specs = optax.tree_map_params(
        abstract.tx,
        _optimizer_spec(mesh),
        abstract.opt_state,
        param_specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P) or _has_own_layout(x),
    )
    specs = abstract.replace(step=P(), params=param_specs, opt_state=opt_specs)
    shardings = sharding_lib.named(mesh, specs)
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        abstract,
        shardings,
    )


def _has_own_layout(node: Any) -> bool:
    """Per-parameter optimizer state not shaped like its parameter (Shampoo's blocks)."""
    return node is None or isinstance(node, shampoo_lib.ShampooBlocks)


def _optimizer_spec(mesh: Mesh) -> Callable[[Any, P], Any]:
    """`spec(state entry, its parameter's spec)`: state shaped like its parameter is laid out
    like it; Shampoo's block statistics spread their block dimension over the mesh."""

    def spec(node: Any, param_spec: P) -> Any:
        if isinstance(node, shampoo_lib.ShampooBlocks):
            return node.partition_specs(mesh)
        return None if node is None else param_spec

    return spec


def create_train_state(
    model_config: ModelConfig,
    optimizer_config: DenseOptimizerConfig,
    mesh: Mesh,
    rng: jax.Array | int,
    *,
    num_dense: int,
    num_features: int,
    embedding_dim: int,
) -> TrainState:
    """Initializes the tower and optimizer state directly in their sharded layout.

    Every process must pass the same `rng` (a key or an int seed): the initializer runs
    as one global computation, so parameters never exist unsharded on a host.

    Args:
        model_config: tower and sharding rules.
        optimizer_config: dense optimizer and schedule.
        mesh: from `make_mesh`.
        rng: PRNG key or integer seed for the parameter initialization.
        num_dense: dense features per example.
        num_features: pooled embedding features F per example.
        embedding_dim: embedding dimension D.
    """
    if isinstance(rng, int):
        rng = jax.random.key(rng)
    dims = {"num_dense": num_dense, "num_features": num_features, "embedding_dim": embedding_dim}
    abstract = abstract_train_state(model_config, optimizer_config, mesh, **dims)
    shardings = state_sharding(abstract)
    init = jax.jit(
        _init_fn(model_config, optimizer_config, dims),
        in_shardings=sharding_lib.replicated(mesh),  # rng: the same key on every device
        out_shardings=shardings,  # state: born in its final sharded layout
    )
    lowered = init.lower(rng)
    # The initializer runs once; on CPU its compile time dominates, so skip the expensive
    # backend optimizations there (3-4x faster to compile, same values).
    options = _FAST_COMPILE if mesh.devices.flat[0].platform == "cpu" else None
    return lowered.compile(compiler_options=options)(rng)


_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def state_sharding(state: TrainState) -> TrainState:
    """The tree of `NamedSharding`s of a (concrete or abstract) state."""
    return jax.tree.map(lambda leaf: leaf.sharding, state)


def logits_fn(
    graphdef: nnx.GraphDef, params: Any, embeddings: jax.Array, dense: jax.Array
) -> jax.Array:
    """The tower's logits `[B]` (compute dtype) for embeddings `[B, F, D]` and dense `[B, n]`."""
    return nnx.merge(graphdef, params)(embeddings, dense)


def mean_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean sigmoid cross-entropy of logits [B] against labels [B], in float32 or wider."""
    dtype = jnp.promote_types(labels.dtype, jnp.float32)
    return optax.sigmoid_binary_cross_entropy(logits.astype(dtype), labels.astype(dtype)).mean()


def loss_fn(graphdef: nnx.GraphDef, params: Any, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Mean sigmoid cross-entropy over the (global) batch, computed in float32 or wider."""
    logits = logits_fn(graphdef, params, batch["embeddings"], batch["dense"])
    return mean_cross_entropy(logits, batch["labels"])


def train_step(
    state: TrainState, batch: Mapping[str, jax.Array]
) -> tuple[TrainState, dict[str, jax.Array], jax.Array]:
    """One synchronous update of the dense parameters.

    Args:
        state: the current state.
        batch: `embeddings` [B, F, D] f32 pooled embeddings, `dense` [B, n_dense] f32,
            `labels` [B] f32 in {0, 1}; B is the global batch.

    Returns:
        The updated state; metrics (device scalars: `loss` of this batch before the update,
        `grad_norm`, `learning_rate` used, `finite` = loss and gradient are finite); and
        `embedding_grads` [B, F, D] f32 = d(mean loss)/d(embeddings), so summing them per id
        gives the gradient of the mean loss w.r.t. each embedding row.
    """

    def objective(params, embeddings):
        return loss_fn(state.graphdef, params, {**batch, "embeddings": embeddings})

    loss, (param_grads, embedding_grads) = jax.value_and_grad(objective, argnums=(0, 1))(
        state.params, batch["embeddings"]
    )
    new_state, metrics = apply_dense_gradients(state, loss, param_grads)
    return new_state, metrics, embedding_grads


def apply_dense_gradients(
    state: TrainState, loss: jax.Array, param_grads: Any
) -> tuple[TrainState, dict[str, jax.Array]]:
    """The optimizer update of a step whose loss and parameter gradients are computed.

    Returns the new state and the step's metrics (see `train_step`).
    """
    updates, opt_state = state.tx.update(param_grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(param_grads)
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "learning_rate": jnp.asarray(state.schedule(state.step), jnp.float32),
        "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm),
    }
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(state: TrainState, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Click probabilities `[B]` f32 for `embeddings` [B, F, D] and `dense` [B, n_dense]."""
    logits = logits_fn(state.graphdef, state.params, batch["embeddings"], batch["dense"])
    return jax.nn.sigmoid(logits.astype(jnp.float32))


class ShardedStep:
    """A step function jitted once over a mesh, with explicit shardings.

    The state's shardings are read from the first state passed in (created by
    `create_train_state` or restored into `abstract_train_state`) unless given up front.
    Calls run under `jax.transfer_guard("disallow")`: passing host arrays, or anything
    that would need an implicit copy, fails instead of silently slowing the step.
    """

    def __init__(
        self,
        function: Callable,
        mesh: Mesh,
        batch_keys: tuple[str, ...],
        make_jitted: Callable[[TrainState], Callable],
        state_shardings: TrainState | None = None,
    ):
        self.function = function
        self.mesh = mesh
        self.batch_keys = batch_keys
        self._make_jitted = make_jitted
        self._jitted = None if state_shardings is None else make_jitted(state_shardings)

    def jitted(self, state: TrainState) -> Callable:
        if self._jitted is None:
            shardings = state_sharding(state)
            for leaf in jax.tree.leaves(shardings):
                if not isinstance(leaf, NamedSharding) or leaf.mesh != self.mesh:
                    raise ValueError(
                        "the state is not laid out on this step's mesh; create it with "
                        "create_train_state(..., mesh) or restore it into abstract_train_state"
                    )
            self._jitted = self._make_jitted(shardings)
        return self._jitted

    def _select(self, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        missing = [key for key in self.batch_keys if key not in batch]
        if missing:
            raise KeyError(f"batch lacks {missing}; it needs {list(self.batch_keys)}")
        return {key: batch[key] for key in self.batch_keys}

    def __call__(self, state: TrainState, batch: Mapping[str, jax.Array]):
        batch = self._select(batch)
        # Executing with donated buffers crashes the CPU runtime instead of raising. A
        # donation deletes every buffer of the state, so its step counter tells.
        if state.step.is_deleted():
            raise ValueError(
                "this state was donated to an earlier train step; pass the state it returned"
            )
        jitted = self.jitted(state)
        with jax.transfer_guard("disallow"):
            return jitted(state, batch)

    def lower(self, state: TrainState, batch: Mapping[str, jax.Array]):
        """Lowers the step for these arguments (for cost analysis or inspecting HLO)."""
        return self.jitted(state).lower(state, self._select(batch))

    def num_compilations(self) -> int:
        """Executables in the jit cache behind this step: it grows only when a call needs a
        new compile (new shapes or layouts), never across same-shape calls. The cache is
        JAX's, shared by every step built from the same config and mesh in this process."""
        return 0 if self._jitted is None else self._jitted._cache_size()


def make_train_step(mesh: Mesh, *, state_shardings: TrainState | None = None) -> ShardedStep:
    """Jits `train_step` once for `mesh`: `state, metrics, embedding_grads = step(state, batch)`.

    The tower comes with the state (its graphdef); the state's layout from the first state
    passed in, unless `state_shardings` gives it up front.
    """
    batch_shardings = sharding_lib.train_batch_sharding(mesh)

    def make_jitted(shardings: TrainState):
        return jax.jit(
            train_step,
            in_shardings=(
                shardings,  # state: parameters by partition rules, step replicated
                batch_shardings,  # batch: examples split over "data", replicated over "model"
            ),
            out_shardings=(
                shardings,  # new state: same layout, so it feeds the next call unchanged
                sharding_lib.replicated(mesh),  # metrics: scalars on every device
                sharding_lib.batch_sharding(mesh, 3),  # embedding grads: laid out like embeddings
            ),
            donate_argnums=(0,),  # the old state's buffers become the new state's
        )

    return ShardedStep(
        train_step, mesh, ("embeddings", "dense", "labels"), make_jitted, state_shardings
    )


def make_eval_step(mesh: Mesh, *, state_shardings: TrainState | None = None) -> ShardedStep:
    """Jits `eval_step` once for `mesh`: `probabilities [B] = step(state, batch)` (labels ignored)."""
    batch_shardings = {
        "embeddings": sharding_lib.batch_sharding(mesh, 3),
        "dense": sharding_lib.batch_sharding(mesh, 2),
    }

    def make_jitted(shardings: TrainState):
        return jax.jit(
            eval_step,
            in_shardings=(
                shardings,  # state: as trained, not donated (training continues after eval)
                batch_shardings,  # embeddings, dense: examples split over "data"
            ),
            out_shardings=sharding_lib.batch_sharding(mesh, 1),  # probabilities: like labels
        )

    return ShardedStep(eval_step, mesh, ("embeddings", "dense"), make_jitted, state_shardings)


def fetch_metrics(metrics: Mapping[str, jax.Array], step: int | None = None) -> dict[str, float]:
    """Copies step metrics to the host; raises `NonFiniteLossError` if they are not finite.

    Call this only at log steps: it waits for the step to finish.
    """
    host = {key: np.asarray(value).item() for key, value in jax.device_get(dict(metrics)).items()}
    finite = bool(host.pop("finite", True))
    if not finite or not np.isfinite(host.get("loss", 0.0)):
        where = f"at step {step}" if step is not None else "in a step"
        detail = f"loss={host.get('loss')}, grad_norm={host.get('grad_norm')}"
        raise non_finite_loss(f"{where} ({detail})")
    return host


def check_finite_losses(losses: np.ndarray, step: int) -> None:
    """Raises `NonFiniteLossError` if any of the losses fetched up to `step` is not finite."""
    losses = np.asarray(losses, np.float64)
    if not np.all(np.isfinite(losses)):
        raise non_finite_loss(f"at or before step {step} (loss={losses[~np.isfinite(losses)][0]})")


def non_finite_loss(where: str) -> NonFiniteLossError:
    """The one error for a loss or dense gradient that is not finite, with what to do."""
    return NonFiniteLossError(
        f"non-finite loss or dense gradient {where}; the last checkpoint is intact: lower "
        "optimizer.learning_rate or embedding.optimizer.learning_rate, enable "
        "optimizer.gradient_clip_norm, or check the input features for inf/NaN, then --resume"
    )
