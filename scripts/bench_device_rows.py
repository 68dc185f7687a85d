"""The host's side of tables on the devices, per batch: what caps the hybrid loop's rate
when the device step is fast (a GPU), measured on whatever machine runs it.

For batches of Criteo's shape (26 single-valued features, Zipf-distributed ids over
Criteo-like cardinalities, the long tail widened as `bench_gpu`'s data), every table on the
devices, the three stages the hybrid loop runs on three threads: `DeviceRows.dedupe` (each
table's distinct ids: the input thread), `DeviceRows.prepare` (ids to rows, new ids given
rows, in step order: the lookup thread) and `DeviceRows.device_arrays` (the new rows'
initial values and every array onto the devices, waited for: the transfer thread), each
timed over --batches-timed batches after --warm batches have filled the tables.

    python scripts/bench_device_rows.py                         # batch 4096, 16384, 65536
    python scripts/bench_device_rows.py --batches 16384 --dim 128
    python scripts/bench_device_rows.py --cache 1048576   # the long tail behind a cache
    python scripts/bench_device_rows.py --fused   # one device table, as the planner fuses them
    python scripts/bench_device_rows.py --fused --map-in-step   # the step maps the ids

With --cache ROWS the long-tail features' tables (those the data widens) stay in a host
store with one hot-row cache of ROWS rows on the devices in front of them, as the planner
fuses caches; `prepare` then also counts, admits and evicts, and reads the admitted rows
from the store.

With --map-in-step the step maps the ids itself (`embedding.map_ids = "devices"`,
`model.device_ids`): the host's stages are then `DeviceIds.prepare` (the features' id
columns stacked, [F, B, 2] uint32 halves) and the copy to the devices, and `map_ms_bB` times what moved into the
step: the jitted mapping alone (distinct ids, the hash table's finds and inserts, the new
rows' initial values) on the devices, its tables carried from batch to batch.

The last line is one JSON object: per batch B, dedupe_ms_bB, prepare_ms_bB,
device_arrays_ms_bB, host_side_samples_per_s_bB (B over the slowest stage: the ceiling of
the hybrid loop's rate with device tables), one_thread_samples_per_s_bB (B over the three
together) and shapes_bB (the distinct sets of array shapes over all the batches: the
step's compiles); with --cache, cache_hit_rate_bB (of the cached features' lookups in the
timed batches, the share the cache held); with --map-in-step, map_ms_bB.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import numpy as np
from hybridrec.embedding_store import EmbeddingStore, SparseOptimizerConfig, TableConfig
from hybridrec.model import make_mesh
from hybridrec.model.config import MeshConfig
from hybridrec.model.device_tables import (
    DeviceTable,
    DeviceTableLayout,
    SparseRule,
    init_tables,
    map_batch,
)
from hybridrec.pipeline.synthetic import (
    CATEGORICAL_PROFILE,
    LONG_TAIL,
    scaled_cardinality,
    zipf_ranks,
)
from hybridrec.training.data.input import Batch, DataPosition
from hybridrec.training.device.held_rows import DeviceRows
from hybridrec.training.device.mapped_ids import DeviceIds, map_on_devices
from hybridrec.training.device.plan import DevicePlan

MAX_ROWS = 4_000_000  # rows per device table at the most


def _rows(
    plan_tables: int,
    dim: int,
    scale: float,
    cache: int = 0,
    fused: bool = False,
    in_step: bool = False,
):
    """DeviceRows over one table per Criteo feature, Adagrad, every table on the devices;
    with `cache`, the long-tail ones in a host store behind one cache of that many rows;
    `fused`: the whole tables in one device table, as `embedding.fuse_tables` plans them;
    `in_step`: DeviceIds, the step mapping the ids."""
    optimizer = SparseOptimizerConfig(name="adagrad", learning_rate=0.05)
    rule = SparseRule(
        optimizer.name,
        optimizer.learning_rate,
        optimizer.eps,
        optimizer.beta1,
        optimizer.beta2,
        optimizer.initial_accumulator,
    )
    cards = [scaled_cardinality(card, scale) for card, _, _ in CATEGORICAL_PROFILE[:plan_tables]]
    names = [f"C{j + 1}" for j in range(len(cards))]
    tail = [
        j for j, (card, _, _) in enumerate(CATEGORICAL_PROFILE[:plan_tables]) if card >= LONG_TAIL
    ]
    whole = [j for j in range(len(cards)) if not (cache and j in tail)]
    tables = [
        DeviceTable(names[j], (j,), rows=min(MAX_ROWS, 2 * cards[j] + 1024), dim=dim, rule=rule)
        for j in whole
    ]
    features = {names[j]: (names[j],) for j in whole}
    store_tables = {names[j]: names[j] for j in whole}
    prefixes = {names[j]: (j + 1,) for j in whole}
    if fused:
        rows = sum(t.rows for t in tables)
        tables = [DeviceTable("fused", tuple(whole), rows=rows, dim=dim, rule=rule)]
        features = {"fused": tuple(names[j] for j in whole)}
        store_tables = {"fused": "fused"}
        prefixes = {"fused": tuple(j + 1 for j in whole)}
    configs = {
        name: TableConfig(name=name, dim=dim, capacity=8_000_000, optimizer=optimizer)
        for name in [*names, "fused"]
    }
    store = None
    if cache:
        tables.append(DeviceTable("cache", tuple(tail), rows=cache, dim=dim, rule=rule, cache=True))
        features["cache"] = tuple(names[j] for j in tail)
        store_tables["cache"] = "tail"
        prefixes["cache"] = tuple(j + 1 for j in tail)
        configs["tail"] = TableConfig(name="tail", dim=dim, capacity=1 << 30, optimizer=optimizer)
        store = EmbeddingStore([configs["tail"]])
    plan = DevicePlan(
        DeviceTableLayout(tuple(tables), len(cards)),
        features,
        store_tables,
        prefixes,
        8,
        all_features=tuple(names),
    )
    mesh = make_mesh(MeshConfig(shape=(1,)), jax.devices()[:1])
    if in_step:
        plan = map_on_devices(plan, "devices", configs, platform="any", multi_valued={})
        return DeviceIds(plan, mesh), cards, names
    rows = DeviceRows(plan, configs, mesh, "sum", store=store, staleness=4 if cache else 0)
    return rows, cards, names


def _mapping(rows: DeviceIds):
    """(the device tables, the jitted mapping of a batch's ids on them) of `rows`."""
    layout = rows.plan.layout
    step = jax.jit(functools.partial(map_batch, layout), donate_argnums=(0,))
    return init_tables(layout, rows.mesh), step


def feature_ids(rng, size: int, feature: int, card: int) -> np.ndarray:
    """[size] Zipf ids of Criteo feature `feature` (its generator exponent) over `card`
    values, prefixed per feature as the pipeline's hashed ids are."""
    ranks = zipf_ranks(rng, size, card, CATEGORICAL_PROFILE[feature][1])
    mixed = ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return (np.uint64(feature + 1) << np.uint64(56)) | (mixed >> np.uint64(8))


def _batches(count: int, size: int, cards, names, seed: int) -> list[Batch]:
    """Batches of Zipf ids (the generator's exponents), prefixed per feature."""
    rng = np.random.default_rng(seed)
    position = DataPosition(**{name: 0 for name in DataPosition.__dataclass_fields__})
    out = []
    for _ in range(count):
        ids = {}
        for j, (card, name) in enumerate(zip(cards, names, strict=True)):
            ids[name] = feature_ids(rng, size, j, card)
        out.append(
            Batch(
                dense=np.zeros((size, 13), np.float32),
                labels=np.zeros(size, np.float32),
                ids=ids,
                valid=np.ones(size, bool),
                position=position,
            )
        )
    return out


def _shapes(prepared) -> tuple:
    return tuple(sorted((key, array.shape) for key, array in prepared.arrays.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--cardinality-scale", type=float, default=10.0)
    parser.add_argument("--warm", type=int, default=6, help="batches before the timing")
    parser.add_argument("--batches-timed", type=int, default=8)
    parser.add_argument(
        "--cache", type=int, default=0, help="rows of a hot-row cache for the long tail (0: none)"
    )
    parser.add_argument(
        "--fused", action="store_true", help="the whole tables in one (embedding.fuse_tables)"
    )
    parser.add_argument(
        "--map-in-step", action="store_true", help="the step maps the ids (embedding.map_ids)"
    )
    args = parser.parse_args()
    summary = {}
    for size in args.batches:
        rows, cards, names = _rows(
            len(CATEGORICAL_PROFILE),
            args.dim,
            args.cardinality_scale,
            args.cache,
            args.fused,
            args.map_in_step,
        )
        tables, mapping = _mapping(rows) if args.map_in_step else (None, None)
        mapped = 0.0
        batches = _batches(args.warm + args.batches_timed, size, cards, names, seed=size)
        shapes = set()  # each distinct set of the step's input shapes is one compile
        for batch in batches[: args.warm]:  # their copies compile as the step does
            prepared = rows.prepare(batch)
            arrays = rows.device_arrays(prepared, slice(None))
            if mapping is not None:  # the warm batches fill the tables
                tables, _ = jax.block_until_ready(mapping(tables, arrays))
            shapes.add(_shapes(prepared))
        timed = batches[args.warm :]
        before = dict(rows.summary().get("caches", {}).get("cache", {}))
        times = np.zeros(3)  # dedupe, prepare, device_arrays
        for batch in timed:
            start = time.perf_counter()
            deduped = rows.dedupe(batch)
            deduped_at = time.perf_counter()
            prepared = rows.prepare(batch, deduped)
            prepared_at = time.perf_counter()
            arrays = jax.block_until_ready(rows.device_arrays(prepared, slice(None)))
            times += np.diff([start, deduped_at, prepared_at, time.perf_counter()])
            shapes.add(_shapes(prepared))
            if mapping is not None:
                start = time.perf_counter()
                tables, _ = jax.block_until_ready(mapping(tables, arrays))
                mapped += time.perf_counter() - start
        dedupe, prepare, transfer = times / len(timed)
        rate, one_thread = size / max(dedupe, prepare, transfer), size / (times.sum() / len(timed))
        print(
            f"batch {size}: dedupe {dedupe * 1e3:.1f} ms (input thread), prepare "
            f"{prepare * 1e3:.1f} ms (lookup thread), device_arrays {transfer * 1e3:.1f} ms "
            f"(transfer thread): {rate:,.0f} samples/s at the slowest stage, {one_thread:,.0f} "
            f"on one thread; {len(shapes)} batch shapes in {len(batches)} batches",
            flush=True,
        )
        if mapping is not None:
            summary[f"map_ms_b{size}"] = round(mapped / len(timed) * 1e3, 2)
            print(f"  in the step: the ids mapped in {summary[f'map_ms_b{size}']} ms", flush=True)
        if args.cache:
            held = rows.summary()
            after = held["caches"]["cache"]
            hits = (after["hits"] - before["hits"]) / max(after["lookups"] - before["lookups"], 1)
            summary[f"cache_hit_rate_b{size}"] = round(hits, 4)
            print(
                f"  cache of {args.cache:,} rows: {held['rows']['cache']:,} held, "
                f"hit rate {hits:.4f} in the timed batches, {after['evicted']:,} evicted in all",
                flush=True,
            )
        summary.update(
            {
                f"dedupe_ms_b{size}": round(dedupe * 1e3, 2),
                f"prepare_ms_b{size}": round(prepare * 1e3, 2),
                f"device_arrays_ms_b{size}": round(transfer * 1e3, 2),
                f"host_side_samples_per_s_b{size}": round(rate),
                f"one_thread_samples_per_s_b{size}": round(one_thread),
                f"shapes_b{size}": len(shapes),
            }
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
