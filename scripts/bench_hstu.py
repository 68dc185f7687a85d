"""HSTU on an accelerator: the attention's Pallas kernel against the jax.numpy reference, and
a training step of an HSTU block stack with each.

Two measurements, each for the implementations named (--implementations):
- **attention**: forward and backward of `hstu_attention` (bfloat16, --heads x --head-dim)
  at each row length of --lengths, with --tokens tokens a batch (rows = tokens / length),
  one history a row (--history 0) or histories of that mean length packed together; the
  kernel's outputs and gradients are checked against the reference's at the first length;
- **step**: an HSTUEncoder (--step-blocks blocks of width --step-dim) trained with Adam on
  rows of --step-length tokens: forward, backward and update, in tokens/s.

On a CPU, --interpret runs the kernel in Pallas interpret mode (slow: tiny sizes only).

    python scripts/bench_hstu.py                                    # a GPU: 1k, 4k, 8k a row
    python scripts/bench_hstu.py --lengths 64 --tokens 256 --step-length 64 --step-dim 32 \
        --interpret                                                 # a CPU rehearsal

The last line is one JSON object: platform, device_kind; per length L and implementation
I ('reference' or 'pallas'): attention_ms_I_lL (forward and backward), attention_tflops_I_lL
(counting live pairs only), kernel_speedup_lL (reference time over the kernel's, at its best block size; --extra-blocks B
adds attention_ms_pallas_bB_lL),
kernel_max_error (the largest error of outputs and gradients relative to the reference's
largest value); time_buckets (--time-buckets: every pair's score also biased by its time
gap's bucket, as HSTU on data with times); step_tokens_per_s_I, step_tflops_I, step_speedup;
step_mfu_I (the step's model FLOP/s over the device's dense bf16 peak, `peak_tflops`:
--peak-tflops, else the vendor's figure for a device kind in BF16_PEAK_TFLOPS; absent on
a device of unknown peak); and an error_* key for a measurement that failed (out of
memory, say), the others still measured.

NVIDIA's HSTU training benchmark shape (recsys-examples: 8 blocks, width 1024, 4,096
positions a row, bf16; 31% of an H100's peak with its CUTLASS kernel):

    python scripts/bench_hstu.py --skip attention --step-blocks 8 --step-dim 1024 \
        --heads 4 --head-dim 256 --step-length 4096 --step-history 0
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from hybridrec.model.hstu import HSTUEncoder, hstu_flops_per_token
from hybridrec.model.hstu_attention import (
    hstu_attention_pallas,
    hstu_attention_reference,
    live_pairs,
)


def _timed(fn, *args, min_seconds: float, max_rounds: int = 50) -> tuple[float, float]:
    """(seconds to compile and run once, median seconds a call after one warm-up)."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    jax.block_until_ready(fn(*args))
    times: list[float] = []
    while len(times) < max_rounds and (len(times) < 3 or sum(times) < min_seconds):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def _segments(rows: int, length: int, history: int, rng) -> np.ndarray:
    """[rows, length] segment ids: one history a row (history 0) or packed histories of
    mean length `history` (geometric lengths)."""
    if history <= 0:
        return np.zeros((rows, length), np.int32)
    out = np.empty((rows, length), np.int32)
    for row in range(rows):
        lengths = rng.geometric(1.0 / history, size=length)
        out[row] = np.repeat(np.arange(length), lengths)[:length]
    return out


def _times(rows: int, length: int, rng) -> np.ndarray:
    """[rows, length] int32 event times: gaps of a second to a few weeks, log-uniform."""
    gaps = np.exp(rng.uniform(0, 15, size=(rows, length))).astype(np.int64)
    return (np.cumsum(gaps, axis=1) % 2**31).astype(np.int32)


def _attention_fn(implementation: str, args, block: int, times):
    settings = dict(alpha=args.head_dim**-0.5, inv_norm=1.0 / 256, max_distance=256)
    settings.update(times=times)
    argnums = (0, 1, 2, 4, 5) if args.time_buckets else (0, 1, 2, 4)

    def attend(q, k, v, segments, bias, time_bias):
        if implementation == "reference":
            return hstu_attention_reference(q, k, v, segments, bias, time_bias=time_bias, **settings)  # fmt: skip
        return hstu_attention_pallas(
            q, k, v, segments, bias, **settings, interpret=args.interpret,
            block_q=block, block_k=block, block_backward=block, time_bias=time_bias,
        )  # fmt: skip

    def loss(q, k, v, segments, bias, time_bias, weights):
        return jnp.sum(attend(q, k, v, segments, bias, time_bias).astype(jnp.float32) * weights)

    return jax.jit(attend), jax.jit(jax.grad(loss, argnums=argnums))


def _max_error(expected, actual) -> float:
    worst = 0.0
    for e, a in zip(jax.tree.leaves(expected), jax.tree.leaves(actual), strict=True):
        e, a = np.asarray(e, np.float32), np.asarray(a, np.float32)
        worst = max(worst, float(np.abs(e - a).max() / max(np.abs(e).max(), 1e-12)))
    return worst


def bench_attention(args, summary: dict) -> None:
    rng = np.random.default_rng(0)
    dtype = jnp.dtype(args.dtype)
    for index, length in enumerate(args.lengths):
        rows = max(1, args.tokens // length)
        shape = (rows, length, args.heads, args.head_dim)
        q, k, v = (jnp.asarray(rng.normal(size=shape), dtype) for _ in range(3))
        weights = jnp.asarray(rng.normal(size=shape), jnp.float32)
        segments = jnp.asarray(_segments(rows, length, args.history, rng))
        bias = jnp.asarray(rng.normal(size=(args.heads, 32)) * 0.1, jnp.float32)
        times, time_bias = None, None
        if args.time_buckets:
            times = jnp.asarray(_times(rows, length, rng))
            time_bias = jnp.asarray(rng.normal(size=(args.heads, args.time_buckets)) * 0.1, jnp.float32)  # fmt: skip
        pairs = float(live_pairs(segments).sum())
        flops = 7 * 2 * pairs * args.heads * args.head_dim  # 2 products forward, 5 backward
        results = {}
        variants = [(name, args.block) for name in args.implementations]
        if "pallas" in args.implementations:
            variants += [("pallas", block) for block in args.extra_blocks if length % block == 0]
        for implementation, block in variants:
            label = implementation if block == args.block else f"{implementation}_b{block}"
            forward, grad = _attention_fn(implementation, args, block, times)
            inputs = (q, k, v, segments, bias, time_bias)
            try:
                compile_s, seconds = _timed(grad, *inputs, weights, min_seconds=args.min_seconds)
                if index == 0 and label == implementation:
                    results[implementation] = (forward(*inputs), grad(*inputs, weights))
            except Exception as error:  # out of memory, a kernel that fails: report, go on
                traceback.print_exc()
                message = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
                summary[f"error_attention_{label}_l{length}"] = message
                print(f"attention {label} at {length} a row: {message}", flush=True)
                continue
            summary[f"attention_ms_{label}_l{length}"] = round(seconds * 1e3, 3)
            summary[f"attention_tflops_{label}_l{length}"] = round(flops / seconds / 1e12, 2)
            print(
                f"attention {label:11s} {rows} x {length} tokens, {args.heads} heads x "
                f"{args.head_dim}: {seconds * 1e3:9.2f} ms forward+backward, "
                f"{flops / seconds / 1e12:7.2f} TFLOP/s (compile {compile_s:.1f} s)",
                flush=True,
            )
        reference = summary.get(f"attention_ms_reference_l{length}")
        kernels = [
            value for key, value in summary.items()
            if key.startswith("attention_ms_pallas") and key.endswith(f"_l{length}")
        ]  # fmt: skip
        kernel = min(kernels, default=None)  # the best block size's
        if reference and kernel:
            summary[f"kernel_speedup_l{length}"] = round(reference / kernel, 2)
        if len(results) == 2:
            summary["kernel_max_error"] = round(
                _max_error(results["reference"], results["pallas"]), 5
            )
            print(
                f"kernel against reference at {length}: max relative error {summary['kernel_max_error']}"
            )


# dense bf16 tensor-core peak, TFLOP/s, by the start of jax's device_kind (vendors' sheets)
BF16_PEAK_TFLOPS = {
    "NVIDIA H200": 989.4,
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA H100": 989.4,  # SXM
    "NVIDIA A100": 312.0,
    "NVIDIA L4": 121.0,
}


def peak_tflops(device_kind: str, given: float) -> float | None:
    """The device's dense bf16 peak: `given` (> 0), else the table's first kind that
    `device_kind` starts with, else None."""
    if given > 0:
        return given
    for kind, peak in BF16_PEAK_TFLOPS.items():
        if device_kind.startswith(kind):
            return peak
    return None


def bench_step(args, summary: dict) -> None:
    rng = np.random.default_rng(1)
    dtype = jnp.dtype(args.dtype)
    rows = max(1, args.tokens // args.step_length)
    x = jnp.asarray(rng.normal(size=(rows, args.step_length, args.step_dim)), dtype)
    target = jnp.asarray(rng.normal(size=x.shape), dtype)
    segments = jnp.asarray(_segments(rows, args.step_length, args.step_history, rng))
    event_times = jnp.asarray(_times(rows, args.step_length, rng)) if args.time_buckets else None
    attended = float(live_pairs(segments).sum()) / segments.size
    flops = hstu_flops_per_token(
        args.step_dim, args.step_blocks, args.heads, args.head_dim, attended
    )
    for implementation in args.implementations:
        model = HSTUEncoder(
            args.step_dim, blocks=args.step_blocks, heads=args.heads, head_dim=args.head_dim,
            dtype=dtype, rngs=nnx.Rngs(0), implementation=implementation,
            time_buckets=args.time_buckets,
        )  # fmt: skip
        graphdef, params = nnx.split(model, nnx.Param)
        optimizer = optax.adam(1e-3)
        state = (params, optimizer.init(params))

        def step(state, x, target, segments, graphdef=graphdef, optimizer=optimizer):
            params, opt_state = state

            def loss(params):
                out = nnx.merge(graphdef, params)(x, segments, event_times)
                return jnp.mean((out.astype(jnp.float32) - target.astype(jnp.float32)) ** 2)

            value, grads = jax.value_and_grad(loss)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), value

        step = jax.jit(step, donate_argnums=0)

        def run(state, step=step):
            return step(state, x, target, segments)

        try:
            start = time.perf_counter()
            state, _ = jax.block_until_ready(run(state))
            compile_s = time.perf_counter() - start
            times = []
            while len(times) < 50 and (len(times) < 3 or sum(times) < args.min_seconds):
                start = time.perf_counter()
                state, value = jax.block_until_ready(run(state))
                times.append(time.perf_counter() - start)
            if not np.isfinite(float(value)):
                raise FloatingPointError(f"non-finite loss {float(value)}")
        except Exception as error:
            traceback.print_exc()
            message = (
                f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
            )
            summary[f"error_step_{implementation}"] = message
            print(f"step {implementation}: {message}", flush=True)
            continue
        seconds = statistics.median(times)
        tokens = rows * args.step_length / seconds
        summary[f"step_tokens_per_s_{implementation}"] = round(tokens)
        summary[f"step_tflops_{implementation}"] = round(tokens * flops / 1e12, 2)
        peak = peak_tflops(summary["device_kind"], args.peak_tflops)
        if peak:
            summary["peak_tflops"] = peak
            mfu = tokens * flops / 1e12 / peak
            summary[f"step_mfu_{implementation}"] = float(f"{mfu:.4g}")
        print(
            f"HSTU step {implementation:9s} {args.step_blocks} blocks, d {args.step_dim}, "
            f"{rows} x {args.step_length} tokens: {seconds * 1e3:8.2f} ms, {tokens:,.0f} tokens/s, "
            f"{tokens * flops / 1e12:.2f} TFLOP/s (compile {compile_s:.1f} s)",
            flush=True,
        )
    reference, kernel = (summary.get(f"step_tokens_per_s_{i}") for i in ("reference", "pallas"))
    if reference and kernel:
        summary["step_speedup"] = round(kernel / reference, 2)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--tokens", type=int, default=32768, help="tokens a batch")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--history", type=int, default=0, help="mean history; 0: one a row")
    parser.add_argument("--block", type=int, default=64, help="the kernel's block size")
    parser.add_argument(
        "--extra-blocks", type=int, nargs="*", default=[], help="more block sizes, kernel only"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--step-length", type=int, default=4096)
    parser.add_argument("--step-dim", type=int, default=256)
    parser.add_argument("--step-blocks", type=int, default=4)
    parser.add_argument("--step-history", type=int, default=200, help="mean history, 0: one")
    parser.add_argument(
        "--implementations", nargs="+", default=["reference", "pallas"],
        choices=["reference", "pallas"],
    )  # fmt: skip
    parser.add_argument("--skip", nargs="*", default=[], choices=["attention", "step"])
    parser.add_argument("--min-seconds", type=float, default=1.0, help="timed per measurement")
    parser.add_argument("--interpret", action="store_true", help="the kernel interpreted (CPU)")
    parser.add_argument(
        "--peak-tflops", type=float, default=0.0,
        help="the device's dense bf16 peak for step_mfu_* (0: BF16_PEAK_TFLOPS by device kind)",
    )  # fmt: skip
    parser.add_argument(
        "--time-buckets", type=int, default=0, help="HSTU's time-gap bias (0: none)"
    )
    args = parser.parse_args(argv)
    for length in args.lengths + [args.step_length]:
        if length % args.block:
            parser.exit(2, f"bench_hstu: block {args.block} does not divide length {length}\n")
    device = jax.devices()[0]
    summary = {"platform": device.platform, "device_kind": device.device_kind}
    summary["time_buckets"] = args.time_buckets
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)
    if "attention" not in args.skip:
        bench_attention(args, summary)
    if "step" not in args.skip:
        bench_step(args, summary)
    print(json.dumps(summary))
    failed = [key for key in summary if key.startswith("error_")]
    sys.exit(1 if failed and len(failed) == 2 * len(args.implementations) else 0)


if __name__ == "__main__":
    main()
