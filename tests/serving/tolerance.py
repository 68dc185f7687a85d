"""How far a served probability may be from `evaluate`'s for the same row."""

import jax

# float32 rounding on CPUs. A GPU runs float32 matrix products in TF32 (a 10-bit mantissa)
# with kernels chosen by the batch's size, so one row scored within batches of other sizes
# moves by up to ~1e-4 there (9e-5 measured on an H200).
PARITY = 1e-6 if jax.default_backend() == "cpu" else 5e-4
