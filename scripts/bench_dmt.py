"""DMT placement on Criteo data: bytes that cross hosts per step, flat DLRM vs placed towers.

Simulates `--hosts` hosts on this machine, each with one embedding server and one
trainer process (one CPU device; the trainers form one multi-process JAX job over gloo),
and trains the `criteo_dlrm` preset for one epoch at `--batch` three ways, on the same
global batches:

    flat_dlrm    DLRM, data-parallel; the fused table hash-partitioned over every
                 host's server, so (hosts - 1) / hosts of each process's lookups and
                 updates go to other hosts
    flat_dmt     the same placement, with the DLRM over DMT towers (`model.towers`)
    placed_dmt   tower-parallel DMT: host group t holds tower t's tables on its server,
                 looks up tower t's features for the whole batch there, runs Tower Module
                 t and exchanges only the compressed outputs (all-to-all)

Per layout, summed over the processes of one step: payload bytes to embedding servers on
other hosts (lookups and updates, as the clients count them: Arrow buffers, headers and
table names; with more hosts than towers, placed DMT spreads a tower's tables over its
group's servers, and the part that stays within the group is shown), bytes to the local
server, the tower exchange and the dense gradients' all-reduce (from each step's compiled
HLO, ring algorithm); eval AUC, steady samples/s.
The towers default to the Tower Partitioner's proposal on this sample (docs/models.md);
`--towers '[["C1", ...], ...]'` gives others.

    python scripts/bench_dmt.py                     # the shared Criteo sample
    python scripts/bench_dmt.py --input day_0.gz --hosts 8

The last line is one JSON object: `<layout>_cross_host_embedding_bytes_per_step` (remote
lookups and updates plus the tower exchange), `<layout>_dense_allreduce_bytes_per_step`,
`<layout>_local_store_bytes_per_step`, `<layout>_store_busiest_over_mean` (the busiest
process's store bytes over the mean), `<layout>_auc`, `<layout>_samples_per_s` for
flat_dlrm, flat_dmt and placed_dmt, and `placed_over_flat_dlrm_embedding_bytes`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import bench_criteo  # the preprocessing cache shared with it
from hybridrec.common.errors import ConfigError, UserError
from hybridrec.model.dmt import check_towers
from hybridrec.pipeline import read_metadata
from hybridrec.training.learned.placement import WARMUP_STEPS

from hybridrec.cli.placement_run import launch

REPO = Path(__file__).resolve().parent.parent
# The Tower Partitioner's proposal from the seed-0 DLRM run on the sample (docs/models.md)
PARTITIONER_TOWERS = [
    ["C1", "C2", "C5", "C6", "C8", "C9", "C10", "C14", "C15", "C17", "C18", "C19", "C20",
     "C22", "C23", "C25", "C26"],
    ["C3", "C12", "C21"],
    ["C7", "C11", "C13"],
    ["C4", "C16", "C24"],
]  # fmt: skip
LAYOUTS = ("flat_dlrm", "flat_dmt", "placed_dmt")


def _positions(data: Path, towers: list[list[str]]) -> list[list[int]]:
    names = [feature.name for feature in read_metadata(data).categorical]
    unknown = sorted({name for tower in towers for name in tower} - set(names))
    if unknown:
        bench_criteo._fail(f"--towers names features the data lacks: {unknown}")
    positions = [sorted(names.index(name) for name in tower) for tower in towers]
    try:
        check_towers(positions, len(names))
    except ConfigError as error:
        bench_criteo._fail(f"--towers: {error}")
    return positions


def _summary(records: list[dict]) -> dict[str, float]:
    """One step of the whole cluster: bytes summed over processes; rates of process 0."""
    store = [record["store_bytes_per_step"] for record in records]
    collectives = [record["collective_bytes_per_step"] for record in records]
    exchange = sum(c.get("all-to-all", 0) for c in collectives)
    remote = sum(s["remote"] for s in store)
    per_host = [sum(s.values()) for s in store]
    group = sum(s["group"] for s in store)
    return {
        "cross_host_embedding_bytes_per_step": group + remote + exchange,
        "remote_store_bytes_per_step": group + remote,
        "group_store_bytes_per_step": group,
        "tower_exchange_bytes_per_step": exchange,
        "local_store_bytes_per_step": sum(s["local"] for s in store),
        "dense_allreduce_bytes_per_step": sum(c.get("all-reduce", 0) for c in collectives),
        "auc": records[0]["eval"]["auc"],
        "logloss": records[0]["eval"]["logloss"],
        "samples_per_s": records[0]["steady_samples_per_s"],
        "dense_params": records[0]["dense_params"],
        # lookup load balance over the hosts (the Tower Partitioner balances it within 25%)
        "store_busiest_over_mean": max(per_host) / (sum(per_host) / len(per_host)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", type=Path, help="Criteo-format files")
    parser.add_argument("--cache", type=Path, default=REPO / "runs" / "bench_criteo")
    parser.add_argument("--batch", type=int, default=512, help="global batch")
    parser.add_argument("--hosts", type=int, default=4, help="simulated hosts")
    parser.add_argument("--towers", help="JSON list of towers, each a list of feature names")
    parser.add_argument("--tower-outputs", type=int, default=2)
    parser.add_argument("--steps", type=int, help="steps per run (default: one epoch)")
    parser.add_argument("--eval-batches", type=int, help="default: the whole eval split")
    parser.add_argument("--seed", type=int, default=0, help="the runs' seed")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    args = parser.parse_args()
    if args.steps is not None and args.steps <= WARMUP_STEPS:
        bench_criteo._fail(f"--steps must be more than the {WARMUP_STEPS} warm-up steps")
    data = bench_criteo._dataset(bench_criteo.checked_inputs(args.input), args.cache)
    try:
        named = json.loads(args.towers) if args.towers else PARTITIONER_TOWERS
    except json.JSONDecodeError as error:
        bench_criteo._fail(f"--towers is not JSON ({error})")
    if not isinstance(named, list) or not all(isinstance(tower, list) for tower in named):
        bench_criteo._fail("--towers must be a JSON list of lists of feature names")
    towers = _positions(data, named)
    base = [f"data.batch_size={args.batch}", "data.epochs=1", f"seed={args.seed}"]
    dmt = [f"model.towers={json.dumps(towers)}", f"model.tower_outputs={args.tower_outputs}"]
    overrides = {"flat_dlrm": base, "flat_dmt": base + dmt, "placed_dmt": base + dmt}
    results = {}
    for layout in args.layouts:
        print(f"--- {layout}: {args.hosts} hosts, batch {args.batch}", file=sys.stderr, flush=True)
        try:
            records = launch(
                mode="towers" if layout == "placed_dmt" else "flat",
                data=data,
                preset="criteo_dlrm",
                overrides=overrides[layout],
                hosts=args.hosts,
                steps=args.steps,
                eval_batches=args.eval_batches,
                workdir=args.cache / "dmt_runs" / f"{layout}_seed{args.seed}",
            )
        except (UserError, ConfigError) as error:
            bench_criteo._fail(f"{layout}: {error}")
        results[layout] = _summary(records)
    header = (
        f"{'layout':<11} {'cross-host embedding B/step':>28} {'= other hosts':>14} "
        f"{'(same tower)':>13} {'+ exchange':>11} {'local store':>12} "
        f"{'dense all-reduce':>17} {'AUC':>7} {'samples/s':>10}"
    )
    print(header)
    for layout, row in results.items():
        print(
            f"{layout:<11} {row['cross_host_embedding_bytes_per_step']:>28,.0f} "
            f"{row['remote_store_bytes_per_step']:>14,.0f} "
            f"{row['group_store_bytes_per_step']:>13,.0f} "
            f"{row['tower_exchange_bytes_per_step']:>11,.0f} "
            f"{row['local_store_bytes_per_step']:>12,.0f} "
            f"{row['dense_allreduce_bytes_per_step']:>17,.0f} {row['auc']:>7.4f} "
            f"{row['samples_per_s']:>10,.0f}"
        )
    out: dict[str, float | None] = {}
    for layout in LAYOUTS:
        row = results.get(layout, {})
        for key in (
            "cross_host_embedding_bytes_per_step",
            "dense_allreduce_bytes_per_step",
            "local_store_bytes_per_step",
            "store_busiest_over_mean",
            "auc",
            "samples_per_s",
        ):
            out[f"{layout}_{key}"] = row.get(key)
    flat, placed = results.get("flat_dlrm"), results.get("placed_dmt")
    out["placed_over_flat_dlrm_embedding_bytes"] = (
        placed["cross_host_embedding_bytes_per_step"] / flat["cross_host_embedding_bytes_per_step"]
        if flat and placed
        else None
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
