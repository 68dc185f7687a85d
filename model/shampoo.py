"""Blocked Shampoo with grafting, as an optax `GradientTransformation`.

Shampoo (Gupta et al. 2018; the distributed, blocked form of Anil et al. 2020 and Shi et
al. 2023) preconditions a matrix gradient G [m, n] from both sides,

    L = sum_t G_t G_t^T  [m, m],   R = sum_t G_t^T G_t  [n, n],
    direction = L^{-1/4} M R^{-1/4}          (M: the momentum of G)

a Kronecker-factored approximation of full-matrix AdaGrad. To bound the cost, every matrix
is cut into blocks of at most `block_size` x `block_size` (zero-padded at the edges) and
each block gets its own L and R: the preconditioner is block-diagonal. The inverse roots
(an eigendecomposition per block) are recomputed only every `precondition_every` steps.
Grafting takes the step *size* from a diagonal method (Adam or AdaGrad) and the
*direction* from Shampoo: each block's direction is rescaled to the norm the diagonal
method's update has on that block. Vectors (biases, norms) use the diagonal method alone.

The block statistics of a parameter are stacked along a leading block dimension
`[blocks, rows, rows]`; `ShampooBlocks.partition_specs` spreads that dimension over the
mesh when it divides evenly (each device keeps and inverts its share of the blocks, as
distributed Shampoo assigns blocks to workers), and replicates it otherwise. The inverse
roots come from a coupled Newton iteration (matrix products only, `inverse_fourth_root`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from hybridrec.common.errors import ConfigError
from jax.sharding import Mesh

P = jax.sharding.PartitionSpec
# Newton steps of `inverse_fourth_root`: eigenvalues down to ~1e-7 of the largest reach
# the quadratic phase after ~18 steps.
NEWTON_ITERATIONS = 28


class ShampooBlocks(NamedTuple):
    """The Kronecker-factor statistics of one matrix parameter, one entry per block."""

    left: jax.Array  # [blocks, rows, rows] f32, (decayed) sum of G G^T per block
    right: jax.Array  # [blocks, cols, cols] f32, (decayed) sum of G^T G per block
    left_root: jax.Array  # [blocks, rows, rows] f32, (left + eps)^(-1/4) at the last refresh
    right_root: jax.Array  # [blocks, cols, cols] f32, (right + eps)^(-1/4)

    def partition_specs(self, mesh: Mesh) -> ShampooBlocks:
        """Specs that split the block dimension over as many mesh devices as divide it."""
        blocks = self.left.shape[0]
        spec = P()
        for axes in (tuple(mesh.axis_names), *((name,) for name in mesh.axis_names)):
            size = math.prod(mesh.shape[name] for name in axes)
            if size > 1 and blocks % size == 0:
                spec = P(axes if len(axes) > 1 else axes[0])
                break
        return ShampooBlocks(spec, spec, spec, spec)


class ShampooState(NamedTuple):
    """Optimizer state; `momentum`, `second_moment` and `blocks` mirror the parameters."""

    count: jax.Array  # int32 [], updates applied
    momentum: Any  # first moment of the gradient, like the params
    second_moment: Any  # the grafting method's per-coordinate accumulator, like the params
    blocks: Any  # ShampooBlocks per matrix parameter, None per vector parameter


def _block_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, int] | None:
    """(rows, cols) of one block of a parameter, or None for a vector (diagonal only)."""
    if len(shape) < 2 or math.prod(shape) == 0:
        return None
    rows, cols = math.prod(shape[:-1]), shape[-1]
    return min(block_size, rows), min(block_size, cols)


def _to_blocks(array: jax.Array, rows: int, cols: int) -> jax.Array:
    """[..., n] -> [blocks, rows, cols]: the matrix cut into zero-padded tiles, row-major."""
    matrix = array.reshape(-1, array.shape[-1])
    pad_rows, pad_cols = -matrix.shape[0] % rows, -matrix.shape[1] % cols
    matrix = jnp.pad(matrix, ((0, pad_rows), (0, pad_cols)))
    grid_rows, grid_cols = matrix.shape[0] // rows, matrix.shape[1] // cols
    tiles = matrix.reshape(grid_rows, rows, grid_cols, cols).transpose(0, 2, 1, 3)
    return tiles.reshape(grid_rows * grid_cols, rows, cols)


def _from_blocks(blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The inverse of `_to_blocks`: [blocks, rows, cols] -> `shape` (padding dropped)."""
    _, rows, cols = blocks.shape
    total_rows, total_cols = math.prod(shape[:-1]), shape[-1]
    grid_rows, grid_cols = -(-total_rows // rows), -(-total_cols // cols)
    matrix = blocks.reshape(grid_rows, grid_cols, rows, cols).transpose(0, 2, 1, 3)
    matrix = matrix.reshape(grid_rows * rows, grid_cols * cols)
    return matrix[:total_rows, :total_cols].reshape(shape)


_HIGHEST = jax.lax.Precision.HIGHEST  # f32 matmuls also on accelerators (bf16 passes lose the root)


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, precision=_HIGHEST)


def largest_eigenvalue(statistics: jax.Array, iterations: int = 20) -> jax.Array:
    """Power-iteration estimate of the largest eigenvalue of PSD blocks [..., n, n] -> [...]."""
    vector = jnp.ones(statistics.shape[:-1], statistics.dtype)[..., None]  # [..., n, 1]

    def step(_, vector):
        vector = _matmul(statistics, vector)
        return vector / jnp.maximum(jnp.linalg.norm(vector, axis=-2, keepdims=True), 1e-30)

    vector = jax.lax.fori_loop(0, iterations, step, vector)
    return jnp.sum(vector * _matmul(statistics, vector), axis=(-2, -1))


def inverse_fourth_root(
    statistics: jax.Array, epsilon: float, iterations: int = NEWTON_ITERATIONS
) -> jax.Array:
    """(S + epsilon * max eigenvalue * I)^(-1/4) of symmetric PSD blocks [..., n, n].

    The coupled Newton iteration for inverse p-th roots (p = 4), as distributed Shampoo
    computes them: only matrix products, no eigendecomposition. (Batched `eigh` on the
    CPU runtime deadlocks its shared thread pool when several run at once, as they do on
    a multi-device mesh.) With S scaled so that its spectrum lies in (0, 2.5], each step
    maps an eigenvalue x of M to x (1.25 - x/4)^4, which grows small values 2.44x per step
    and converges quadratically near 1; H accumulates the root.
    """
    size = statistics.shape[-1]
    identity = jnp.eye(size, dtype=statistics.dtype)
    largest = jnp.maximum(largest_eigenvalue(statistics), 1e-30)[..., None, None]
    damped = statistics + epsilon * largest * identity
    # The Frobenius norm bounds the largest eigenvalue from above: the scaled spectrum
    # stays inside the iteration's region of convergence.
    scale = 2.5 / jnp.linalg.norm(damped, axis=(-2, -1), keepdims=True)
    matrix = damped * scale
    root = identity * scale**0.25

    def step(_, carry):
        matrix, root = carry
        factor = 1.25 * identity - 0.25 * matrix
        squared = _matmul(factor, factor)
        return _matmul(_matmul(squared, squared), matrix), _matmul(root, factor)

    _, root = jax.lax.fori_loop(0, iterations, step, (matrix, jnp.broadcast_to(root, matrix.shape)))
    return root


def _accumulate(
    blocks: ShampooBlocks, gradient: jax.Array, beta2: float
) -> tuple[jax.Array, jax.Array]:
    """The block statistics with `gradient` added: (L, R), decayed by beta2 unless it is 1."""
    keep, add = (beta2, 1 - beta2) if beta2 < 1 else (1.0, 1.0)
    tiles = _to_blocks(gradient, blocks.left.shape[-1], blocks.right.shape[-1])
    transposed = jnp.swapaxes(tiles, -1, -2)  # tiles: [blocks, rows, cols]
    return (
        keep * blocks.left + add * tiles @ transposed,
        keep * blocks.right + add * transposed @ tiles,
    )


def _grafted_direction(
    left_root: jax.Array, right_root: jax.Array, momentum: jax.Array, graft: jax.Array
) -> jax.Array:
    """L^-1/4 M R^-1/4 per block, each block rescaled to the norm of `graft` on it.

    Args:
        left_root: [blocks, rows, rows]; right_root: [blocks, cols, cols].
        momentum, graft: like the parameter.
    """
    rows, cols = left_root.shape[-1], right_root.shape[-1]
    direction = left_root @ _to_blocks(momentum, rows, cols) @ right_root
    norms = jnp.linalg.norm(_to_blocks(graft, rows, cols), axis=(1, 2), keepdims=True)
    direction_norms = jnp.linalg.norm(direction, axis=(1, 2), keepdims=True)
    return _from_blocks(direction * norms / jnp.maximum(direction_norms, 1e-30), momentum.shape)


def _finite_or(roots: jax.Array, previous: jax.Array) -> jax.Array:
    """`roots` [blocks, n, n] where a block is all finite, else that block of `previous`."""
    finite = jnp.all(jnp.isfinite(roots), axis=(-2, -1), keepdims=True)
    return jnp.where(finite, roots, previous)


def scale_by_shampoo(
    *,
    block_size: int,
    precondition_every: int,
    grafting: str,
    beta1: float,
    beta2: float,
    epsilon: float,
    matrix_epsilon: float,
) -> optax.GradientTransformation:
    """The Shampoo direction grafted onto Adam's or AdaGrad's step size (no learning rate).

    Args:
        block_size: largest rows/cols of one preconditioner block.
        precondition_every: steps between recomputations of the inverse roots; the first
            `precondition_every` steps use the grafting method alone.
        grafting: "adam" (bias-corrected moments) or "adagrad" (sum of squares).
        beta1: momentum of the gradient (0 = none), used by both directions.
        beta2: decay of Adam's second moment and of the Shampoo statistics; 1 = plain sums.
        epsilon: added to the grafting method's denominator.
        matrix_epsilon: added to each statistics block, relative to its largest eigenvalue.

    Raises:
        ConfigError: `block_size` larger than every dimension of every matrix parameter.
    """

    def init(params) -> ShampooState:
        dimensions = [max(leaf.shape) for leaf in jax.tree.leaves(params) if leaf.ndim >= 2]
        if dimensions and block_size > max(dimensions):
            raise ConfigError(
                f"optimizer.shampoo_block_size = {block_size} is larger than every layer of "
                f"the tower (its largest parameter dimension is {max(dimensions)}); use at "
                f"most {max(dimensions)}"
            )

        def blocks_of(leaf):
            shape = _block_shape(leaf.shape, block_size)
            if shape is None:
                return None
            rows, cols = shape
            count = -(-math.prod(leaf.shape[:-1]) // rows) * -(-leaf.shape[-1] // cols)
            return ShampooBlocks(
                left=jnp.zeros((count, rows, rows), jnp.float32),
                right=jnp.zeros((count, cols, cols), jnp.float32),
                left_root=jnp.broadcast_to(jnp.eye(rows, dtype=jnp.float32), (count, rows, rows)),
                right_root=jnp.broadcast_to(jnp.eye(cols, dtype=jnp.float32), (count, cols, cols)),
            )

        def zeros(tree):
            return jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, jnp.float32), tree)

        return ShampooState(
            count=jnp.zeros((), jnp.int32),
            momentum=zeros(params),
            second_moment=zeros(params),
            blocks=jax.tree.map(blocks_of, params),
        )

    def diagonal_step(gradient, momentum, moment, count):
        """The grafting method's step and its updated momentum and second moment."""
        momentum = beta1 * momentum + (1 - beta1) * gradient if beta1 else gradient
        if grafting == "adam":
            moment = beta2 * moment + (1 - beta2) * gradient**2
            mean = momentum / (1 - beta1**count) if beta1 else momentum
            return mean / (jnp.sqrt(moment / (1 - beta2**count)) + epsilon), momentum, moment
        moment = moment + gradient**2
        return momentum / (jnp.sqrt(moment) + epsilon), momentum, moment

    def update(updates, state: ShampooState, params=None):
        del params
        count = state.count + 1
        refresh = count % precondition_every == 0  # roots recomputed after this step's stats
        preconditioned = count >= precondition_every  # roots exist from the first refresh on
        treedef = jax.tree.structure(updates)
        gradients = [leaf.astype(jnp.float32) for leaf in treedef.flatten_up_to(updates)]
        momenta = treedef.flatten_up_to(state.momentum)
        moments = treedef.flatten_up_to(state.second_moment)
        old_blocks = treedef.flatten_up_to(state.blocks)

        grafts = []
        for index, gradient in enumerate(gradients):
            graft, momenta[index], moments[index] = diagonal_step(
                gradient, momenta[index], moments[index], count
            )
            grafts.append(graft)
        statistics = {  # leaf index -> (left, right), updated with this step's gradient
            index: _accumulate(blocks, gradients[index], beta2)
            for index, blocks in enumerate(old_blocks)
            if blocks is not None
        }
        stale = [(old_blocks[i].left_root, old_blocks[i].right_root) for i in statistics]

        def refreshed():
            # a block whose root is not finite (the iteration failed) keeps its last root
            return [
                tuple(
                    _finite_or(inverse_fourth_root(matrix, matrix_epsilon), previous)
                    for matrix, previous in zip(pair, old, strict=True)
                )
                for pair, old in zip(statistics.values(), stale, strict=True)
            ]

        roots = jax.lax.cond(refresh, refreshed, lambda: stale)

        steps, new_blocks = list(grafts), list(old_blocks)
        for (index, (left, right)), (left_root, right_root) in zip(
            statistics.items(), roots, strict=True
        ):
            shampoo_step = _grafted_direction(left_root, right_root, momenta[index], grafts[index])
            steps[index] = jnp.where(preconditioned, shampoo_step, grafts[index])
            new_blocks[index] = ShampooBlocks(left, right, left_root, right_root)
        steps = [
            step.astype(leaf.dtype)
            for step, leaf in zip(steps, treedef.flatten_up_to(updates), strict=True)
        ]
        new_state = ShampooState(
            count,
            treedef.unflatten(momenta),
            treedef.unflatten(moments),
            treedef.unflatten(new_blocks),
        )
        return treedef.unflatten(steps), new_state

    return optax.GradientTransformation(init, update)


def shampoo(
    learning_rate: optax.ScalarOrSchedule,
    *,
    block_size: int = 128,
    precondition_every: int = 10,
    grafting: str = "adam",
    beta1: float = 0.9,
    beta2: float = 0.999,
    epsilon: float = 1e-8,
    matrix_epsilon: float = 1e-6,
) -> optax.GradientTransformation:
    """Blocked Shampoo grafted onto Adam/AdaGrad, then scaled by `-learning_rate`."""
    return optax.chain(
        scale_by_shampoo(
            block_size=block_size,
            precondition_every=precondition_every,
            grafting=grafting,
            beta1=beta1,
            beta2=beta2,
            epsilon=epsilon,
            matrix_epsilon=matrix_epsilon,
        ),
        optax.scale_by_learning_rate(learning_rate),
    )
