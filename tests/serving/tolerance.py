"""How far a served probability may be from `evaluate`'s for the same row."""

import jax

# float32 rounding on CPUs. A GPU chooses its matrix-product kernels by the batch's size,
# so one row scored within batches of other sizes moves there; in TF32 (a GPU's default,
# the tests' conftest asks for full float32) by up to ~1e-4 (9e-5 measured on an H200).
PARITY = 1e-6 if jax.default_backend() == "cpu" else 5e-4
