"""One process of the multi-process test; also imported by the test for the 1-process run.

Usage: python _multiprocess_worker.py [COORDINATOR NUM_PROCESSES PROCESS_ID] OUT.npz
(without the layout arguments it comes from the HYBRIDREC_* environment variables, read
as the command line reads them; the parent sets XLA_FLAGS so each process has 4 CPU
devices).
"""

from __future__ import annotations

import sys

import numpy as np

GLOBAL_ROWS = 32
STEPS = 3
# data split across the processes, the wide layers split over "model" within each
MESHES = {"4x2": ((4, 2), ("data", "model"))}


def global_batch_rows(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return {
        "embeddings": rng.normal(scale=0.5, size=(GLOBAL_ROWS, 3, 8)).astype(np.float32),
        "dense": rng.normal(size=(GLOBAL_ROWS, 6)).astype(np.float32),
        "labels": (rng.random(GLOBAL_ROWS) < 0.3).astype(np.float32),
    }


def run() -> dict[str, np.ndarray]:
    """Trains a tiny DLRM on both meshes; returns this process's view of the results."""
    import jax
    from hybridrec.model import (
        DenseOptimizerConfig,
        DLRMConfig,
        MeshConfig,
        ModelConfig,
        create_train_state,
        local_rows,
        make_eval_step,
        make_global_batch,
        make_mesh,
        make_train_step,
    )
    from jax.experimental import multihost_utils

    # the tiny DLRM and optimizer of tests/model/conftest.py
    config = ModelConfig(
        tower="dlrm", dlrm=DLRMConfig(bottom_mlp=(16, 8), top_mlp=(32, 16)), min_sharded_width=8
    )
    optimizer = DenseOptimizerConfig(
        name="adam", learning_rate=1e-2, warmup_steps=2, decay="cosine", decay_steps=10
    )
    rows = GLOBAL_ROWS // jax.process_count()
    start = jax.process_index() * rows
    results = {}
    for name, (shape, axes) in MESHES.items():
        mesh = make_mesh(MeshConfig(shape=shape, axis_names=axes))
        state = create_train_state(
            config, optimizer, mesh, 5, num_dense=6, num_features=3, embedding_dim=8
        )
        step = make_train_step(mesh)
        losses, grads = [], []
        for index in range(STEPS):
            local = {k: v[start : start + rows] for k, v in global_batch_rows(index).items()}
            state, metrics, embedding_grads = step(state, make_global_batch(local, mesh))
            losses.append(float(jax.device_get(metrics["loss"])))
            grads.append(local_rows(embedding_grads))
        probabilities = make_eval_step(mesh)(state, make_global_batch(local, mesh))
        params = multihost_utils.process_allgather(state.params, tiled=True)
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        results[f"{name}/losses"] = np.array(losses)
        results[f"{name}/grads"] = np.stack(grads)
        results[f"{name}/probabilities"] = local_rows(probabilities)
        for path, value in flat:
            results[f"{name}/params{jax.tree_util.keystr(path)}"] = np.asarray(value)
    return results


def main(argv: list[str]) -> int:
    from hybridrec.model import maybe_initialize_distributed

    from hybridrec.cli._flags import distributed_from_environment

    if len(argv) == 1:  # layout from HYBRIDREC_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID
        (out,) = argv
        assert maybe_initialize_distributed(**distributed_from_environment())
    else:
        coordinator, num_processes, process_id, out = argv
        assert maybe_initialize_distributed(coordinator, int(num_processes), int(process_id))
    assert maybe_initialize_distributed()  # idempotent
    results = run()
    np.savez(out, **results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
