"""Capacity model of the embedding service: servers, RAM and network for a model size.

Takes the figures `scripts/bench_scale.py` measured (rows/s per server core, wire bytes
per row, rows per sample) and prints, for 1B, 100B and 100T embedding parameters at a
training rate of --samples-per-s, how many shard servers it takes (bound by RAM, by
CPU and by network, whichever is largest), how much RAM and network in total, next to
PERSIA's published 100T deployment. The markdown it prints is the table in docs/scale.md.

    python scripts/capacity_model.py --measured docs/bench_scale.json
    python scripts/capacity_model.py --measured /tmp/bench-scale-XXXX/bench_scale.json --dim 128

Model (per embedding row of `dim` parameters):
  bytes in RAM = dim x value bytes + optimizer state + INDEX_BYTES (id -> slot map,
                 last-access step), over a fill factor of LOAD_FACTOR;
  rows touched per sample = measured (distinct ids per batch / samples per batch);
  server cores = samples/s x rows per sample x 2 (lookup + update) / (rows/s per core),
                 the measured rate scaled down by the payload ratio below (copying,
                 gathering and updating a row cost in proportion to its size; the id
                 lookup does not, so this overestimates the cores);
  wire bytes per row = measured at the bench's dim, scaled by the payload ratio
                 (8 + 4 dim) / (8 + 4 dim_bench): id + float32 row, as the request
                 framing scales the same.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

INDEX_BYTES = 24  # id (8) + slot (8) + last-access step (8) per row in the shard's map
LOAD_FACTOR = 0.8  # rows per allocated slot: the hash map and slot arrays keep headroom
# Storage choices: (label, value bytes per parameter, optimizer state bytes per row given dim)
PRECISIONS = (
    ("f32 + Adam", 4, lambda dim: 2 * 4 * dim),
    ("f32 + Adagrad", 4, lambda dim: 4 * dim),
    ("f32 + row-wise Adagrad", 4, lambda dim: 4),
    ("bf16 + row-wise Adagrad", 2, lambda dim: 4),
)
MODEL_SIZES = (("1B", 1e9), ("100B", 1e11), ("100T", 1e14))
# PERSIA's 100T run on Google Cloud (arXiv 2111.05897, section 6): the embedding tier on
# 30 high-memory VMs of 12 TB RAM, 3,000 CPU cores in all, the dense tier on 64 A100 GPUs.
PERSIA = {"hosts": 30, "ram_tb_per_host": 12.0, "cores": 3000, "gpus": 64}


def bytes_per_row(dim: int, value_bytes: int, optimizer_bytes: int) -> float:
    return (dim * value_bytes + optimizer_bytes + INDEX_BYTES) / LOAD_FACTOR


def plan(parameters: float, dim: int, precision, measured: dict, args) -> dict:
    """Servers, RAM and network for `parameters` embedding parameters at args.samples_per_s."""
    label, value_bytes, optimizer = precision
    rows = parameters / dim
    ram = rows * bytes_per_row(dim, value_bytes, optimizer(dim))
    row_rate = args.samples_per_s * measured["rows_per_sample"] * 2  # lookup + update
    payload_ratio = (8 + 4 * dim) / (8 + 4 * measured["dim"])
    cores = row_rate * payload_ratio / measured["rows_per_server_core_s"]
    wire_per_row = measured["wire_bytes_per_row"] * payload_ratio
    network_gbit = row_rate * wire_per_row * 8 / 1e9
    by_ram = ram / (args.host_ram_tb * 1e12 * args.ram_usable)
    by_cpu = cores / args.host_cores
    by_network = network_gbit / (args.host_network_gbit * args.network_usable)
    hosts = max(1, math.ceil(max(by_ram, by_cpu, by_network)))
    bound = max((by_ram, "RAM"), (by_cpu, "CPU"), (by_network, "network"))[1]
    return {
        "precision": label,
        "rows": rows,
        "ram_tb": ram / 1e12,
        "server_cores": cores,
        "network_gbit": network_gbit,
        "hosts": hosts,
        "bound": bound,
    }


def _amount(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _count(value: float) -> str:
    for threshold, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= threshold:
            return f"{value / threshold:.3g}{suffix}"
    return f"{value:.3g}"


def derived(summary: dict) -> dict:
    """The model's inputs from a bench_scale.py summary."""
    runs = [run for row in summary["runs"].values() for run in row.values()]
    rows_per_sample = sorted(run["rows_per_s"] / run["samples_per_s"] / 2 for run in runs)
    return {
        "rows_per_server_core_s": summary["rows_per_server_core_s"],
        "wire_bytes_per_row": summary["wire_bytes_per_row"],
        "rows_per_sample": rows_per_sample[len(rows_per_sample) // 2],
        "dim": summary["dim"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", required=True, help="bench_scale.json (full results)")
    parser.add_argument("--samples-per-s", type=float, default=1e6, help="training rate")
    parser.add_argument("--dim", type=int, default=64, help="embedding dimension")
    parser.add_argument("--host-ram-tb", type=float, default=12.0, help="RAM per server host")
    parser.add_argument("--host-cores", type=int, default=100, help="cores per server host")
    parser.add_argument("--host-network-gbit", type=float, default=100.0, help="NIC per host")
    parser.add_argument("--ram-usable", type=float, default=0.85, help="RAM share for rows")
    parser.add_argument("--network-usable", type=float, default=0.6, help="NIC share usable")
    args = parser.parse_args(argv)
    measured = derived(json.loads(Path(args.measured).read_text()))
    print(
        f"Measured (bench_scale.py, dim {measured['dim']}): "
        f"{measured['rows_per_server_core_s']:,.0f} lookup+update rows/s per server core, "
        f"{measured['wire_bytes_per_row']:.1f} wire bytes per row, "
        f"{measured['rows_per_sample']:.2f} distinct rows per sample.\n"
        f"Assumed: dim {args.dim}, {args.samples_per_s:,.0f} samples/s, hosts of "
        f"{args.host_ram_tb:g} TB RAM ({args.ram_usable:.0%} for rows), {args.host_cores} cores, "
        f"{args.host_network_gbit:g} Gbit/s ({args.network_usable:.0%} usable).\n"
    )
    print("| parameters | storage | bytes/row | RAM | server cores | network | hosts (bound) |")
    print("|---|---|---|---|---|---|---|")
    for name, parameters in MODEL_SIZES:
        for precision in PRECISIONS:
            result = plan(parameters, args.dim, precision, measured, args)
            row_bytes = bytes_per_row(args.dim, precision[1], precision[2](args.dim))
            print(
                f"| {name} ({_count(result['rows'])} rows) | {result['precision']} | "
                f"{row_bytes:.0f} B | {_amount(result['ram_tb'])} TB | {result['server_cores']:,.0f} | "
                f"{_amount(result['network_gbit'])} Gbit/s | {result['hosts']:,} ({result['bound']}) |"
            )
    persia_ram = PERSIA["hosts"] * PERSIA["ram_tb_per_host"]
    print(
        f"| 100T, PERSIA (published) | fp16 rows, per-row optimizer state | "
        f"{persia_ram * 1e12 / (1e14 / args.dim):.0f} B at most | {persia_ram:.0f} TB | "
        f"{PERSIA['cores']:,} (all CPU) | not published | {PERSIA['hosts']} VMs + "
        f"{PERSIA['gpus']} A100 |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
