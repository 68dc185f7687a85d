"""What the remote-shard tests share: addresses of in-process servers, and one random
sequence of every store call run on several stores that must answer alike."""

import numpy as np
from hybridrec.embedding_store import RaggedIds


def addresses(servers):
    """host:port of each in-process `ShardServer`."""
    return [f"127.0.0.1:{server.port}" for server in servers]


def same_calls(stores, rng, steps):
    """Runs one random sequence of every store call on each store; checks equal results.

    The stores hold tables "ads" (dim 4) and "users" (dim 8)."""
    for step in steps:
        ids = rng.integers(0, 300, size=64).astype(np.uint64)
        grads = rng.normal(size=(64, 4)).astype(np.float32)
        features = {
            "f1": ids[:16],
            "f2": RaggedIds(
                ids[:40], np.array([0, 3, 3, 10, 12, 20, 25, 31, 33, 35, 36] + [40] * 6)
            ),
        }
        pooled_grads = rng.normal(size=(16, 2, 8)).astype(np.float32)
        results = []
        for store in stores:
            store.set_step(step)
            rows = store.lookup("ads", ids).result().copy()
            store.apply_gradients("ads", ids, grads).result()
            pooled = store.lookup_features(
                features, feature_tables={"f1": "users", "f2": "users"}, pooling="sqrtn"
            ).result()
            store.apply_pooled_gradients(pooled, pooled_grads).result()
            results.append((rows, pooled.embeddings.copy()))
        for rows, embeddings in results[1:]:
            np.testing.assert_array_equal(rows, results[0][0])
            np.testing.assert_array_equal(embeddings, results[0][1])
