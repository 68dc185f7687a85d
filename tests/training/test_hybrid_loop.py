"""The hybrid loop in process: the staleness bound, and determinism of the synchronous mode."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from hybridrec.common import config as config_lib
from hybridrec.embedding_store import EmbeddingStore
from hybridrec.pipeline import read_metadata
from hybridrec.training.config import PRESET_DIR, TrainConfig
from hybridrec.training.device import batch_shapes
from hybridrec.training.tables import plan_tables
from hybridrec.training.trainer import Trainer


def _config(dataset, small_model, *extra):
    pairs = small_model(*extra)
    keys = [pairs[i + 1] for i in range(0, len(pairs), 2)]
    return config_lib.load(
        TrainConfig, "quickstart", [*keys, f'data.path="{dataset}"'], preset_dir=PRESET_DIR
    )


class _EventLog:
    """Records, in order, when each batch's lookup is issued and when its update lands.

    Wraps the real store's two calls; staleness is recomputed from these events alone,
    independently of the trainer's own counter.
    """

    def __init__(self, store):
        self.store = store
        self.lock = threading.Lock()
        self.events: list[tuple[str, int]] = []
        self.next_lookup = 0
        self.next_apply = 0
        self._lookup, self._apply = store.lookup_features, store.apply_pooled_gradients
        store.lookup_features = self.lookup_features
        store.apply_pooled_gradients = self.apply_pooled_gradients

    def lookup_features(self, *args, train=True, **kwargs):
        if train:
            with self.lock:
                self.events.append(("lookup", self.next_lookup))
                self.next_lookup += 1
        return self._lookup(*args, train=train, **kwargs)

    def apply_pooled_gradients(self, lookup, grads):
        index = self.next_apply
        self.next_apply += 1
        future = self._apply(lookup, grads)

        def done(_):
            with self.lock:
                self.events.append(("applied", index))

        future.add_done_callback(done)
        return future

    def staleness(self) -> list[int]:
        """For every lookup, how many earlier batches were looked up but not yet applied."""
        pending, out = set(), []
        for kind, index in self.events:
            if kind == "lookup":
                out.append(len(pending))
                pending.add(index)
            else:
                pending.discard(index)
        return out


@pytest.mark.parametrize(("k", "lookahead"), [(0, 1), (2, 1), (2, 0)])
def test_staleness_never_exceeds_k(dataset, small_model, tmp_path, k, lookahead):
    config = _config(
        dataset,
        small_model,
        f"hybrid.staleness={k}",
        f"hybrid.lookahead={lookahead}",
        "data.max_steps=30",
    )
    plan = plan_tables(config.embedding, read_metadata(dataset).categorical)
    store = EmbeddingStore(list(plan.tables), num_shards=2)
    log = _EventLog(store)
    trainer = Trainer(config, tmp_path / "run", quiet=True, store=store)
    summary = trainer.fit()
    store.close()
    measured = log.staleness()
    assert len(measured) == 30
    assert max(measured) <= k
    assert summary["staleness_max"] <= k
    assert sum(summary["staleness_histogram"]) == 30
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert max(r["staleness_max"] for r in records if r["kind"] == "train") <= k
    if k == 0:
        assert summary["staleness_histogram"] == [30]
    else:  # the lookahead really ran ahead of the updates
        assert max(measured) >= 1


def test_synchronous_single_shard_run_is_deterministic(dataset, small_model, tmp_path):
    config = _config(
        dataset,
        small_model,
        "hybrid.staleness=0",
        "embedding.num_shards=1",
        "data.max_steps=25",
        "log.every_steps=1",
    )
    results = []
    for name in ("first", "second"):
        Trainer(config, tmp_path / name, quiet=True).fit()
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        losses = [r["loss"] for r in records if r["kind"] == "train"]
        evaluation = [r for r in records if r["kind"] == "eval"][-1]
        results.append((losses, evaluation["auc"], evaluation["logloss"]))
    assert len(results[0][0]) == 25
    assert results[0] == results[1]
    assert np.isfinite(results[0][1])


def test_tiered_embeddings_train_past_their_ram_budget(
    dataset, small_model, tmp_path, cli, training
):
    # 20 steps x 256 rows: the larger tables see far more distinct ids than 1000 RAM rows each
    run_dir = tmp_path / "tiered"
    keys = small_model(
        "data.max_steps=20",
        "embedding.num_shards=2",
        "embedding.tiering.ram_rows=1000",
        f"embedding.tiering.path={json.dumps(str(tmp_path / 'cold'))}",
    )
    cli(*training.args(dataset, run_dir, "--quiet", *keys))
    store = json.loads((run_dir / "summary.json").read_text())["embedding_store"]
    tables = len({feature.table for feature in read_metadata(dataset).categorical})
    assert store["ram_rows"] == 1000 * tables and store["hot_rows"] <= store["ram_rows"]
    assert store["rows"] > store["hot_rows"] and store["cold_writes"] > 0
    assert store["ram_evictions"] > 0
    assert any((tmp_path / "cold").iterdir())


def test_a_smaller_new_rows_size_compiled_ahead_trains_as_one_taken_at_once(
    dataset, small_model, tmp_path, monkeypatch
):
    """Device tables whose new rows' size comes down as they fill: the trainer compiles
    the smaller size ahead (the train step itself, on a worker) and takes it 3 batches
    later; the losses are those of a run that takes each smaller size at once."""
    compiled, taken = [], []
    real_call, real_compiled = (
        batch_shapes.AheadCompiler.__call__,
        batch_shapes.PaddedSizes.compiled,
    )

    def spied(self, shapes):  # the real compile, recorded
        future = real_call(self, shapes)
        compiled.append((shapes, future))
        return future

    def handed_over(self, key):  # the compile a batch of the smaller size waits for
        future = real_compiled(self, key)
        taken.extend([future] if future is not None else [])
        return future

    monkeypatch.setattr(batch_shapes, "WASTE_BYTES", 1)  # shrink at the first chance
    monkeypatch.setattr(batch_shapes.AheadCompiler, "__call__", spied)
    monkeypatch.setattr(batch_shapes.PaddedSizes, "compiled", handed_over)
    losses = {}
    for name, delay in (("ahead", 3), ("at_once", 0)):
        monkeypatch.setattr(batch_shapes, "SHRINK_DELAY", delay)
        config = _config(
            dataset,
            small_model,
            "hybrid.staleness=0",
            "embedding.num_shards=1",
            "embedding.device_budget=-1",  # the tables on the devices
            "embedding.optimizer.initial_accumulator=0.1",
            "data.max_steps=30",
            "log.every_steps=1",
            "eval.max_batches=2",
        )
        trainer = Trainer(config, tmp_path / name, quiet=True)
        trainer.fit()
        assert trainer.device_rows is not None
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        losses[name] = [r["loss"] for r in records if r["kind"] == "train"]
        ahead = [r["compiles_ahead"] for r in records if r["kind"] == "train"][-1]
        assert (ahead > 0) == bool(delay)  # counted apart from the compiles steps waited for
        if delay:
            assert compiled, "no smaller size was compiled ahead"
            assert all(future.result() for _, future in compiled)  # compiled, no error
            assert all(shape[0] < 65536 for shapes, _ in compiled for shape in shapes.values())
            assert taken and all(any(f is c for _, c in compiled) for f in taken)
    np.testing.assert_allclose(losses["ahead"], losses["at_once"], rtol=1e-6)
