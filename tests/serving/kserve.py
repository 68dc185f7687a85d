"""Open Inference Protocol request bodies the serving tests send."""


def id_and_dense_inputs(ids, dense) -> list[dict]:
    """The "inputs" of a request with ids [B, F] uint64 and dense [B, D] float32."""
    return [
        {
            "name": "ids",
            "datatype": "UINT64",
            "shape": list(ids.shape),
            "data": ids.ravel().tolist(),
        },
        {
            "name": "dense",
            "datatype": "FP32",
            "shape": list(dense.shape),
            "data": dense.ravel().tolist(),
        },
    ]
