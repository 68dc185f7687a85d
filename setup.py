"""The compiled parts: the embedding store's hot-path kernels (embedding_store/_native.c)
and the serving catalogue's scan (serving/_scan.c).

Plain C against the CPython API, built by whatever C compiler pip finds; everything else
about the package is in pyproject.toml. Without a compiler the build fails, and a source
tree used without installing runs the store's numpy kernels instead (slower, same results).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hybridrec.embedding_store._native",
            sources=["embedding_store/_native.c"],
            # no fused multiply-adds: the kernels give the numpy versions' float32 bits
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"],
        ),
        # the catalogue scan's first stage: bounds, not bit-exact results, so fused
        # multiply-adds are welcome; one clone per instruction set (serving/_scan.c)
        Extension(
            "hybridrec.serving._scan",
            sources=["serving/_scan.c"],
            extra_compile_args=["-O3", "-fno-math-errno"],
        ),
    ]
)
