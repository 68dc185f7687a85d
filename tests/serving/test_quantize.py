"""Row-wise int8 and fp16 tables: error bounds, sizes, and the exported directories."""

from __future__ import annotations

import json

import numpy as np
from hybridrec.serving import ServedModel
from hybridrec.serving.quantize import dequantize_rows, encode_table, quantize_rows


def test_int8_rows_are_within_half_a_step_of_fp32():
    rng = np.random.default_rng(0)
    values = rng.normal(0, 0.05, (1000, 16)).astype(np.float32)
    values[0] = 0.25  # a constant row
    values[1] = [1e-3] * 8 + [-2.0] * 8  # a wide row
    codes, scale_bias = quantize_rows(values)
    assert codes.dtype == np.uint8 and scale_bias.dtype == np.float16
    restored = dequantize_rows(codes, scale_bias)
    step = scale_bias[:, :1].astype(np.float32)
    fp16_slack = np.abs(values).max(axis=1, keepdims=True) * 2e-3
    assert np.all(np.abs(restored - values) <= step / 2 + fp16_slack)
    np.testing.assert_allclose(restored[0], 0.25, atol=1e-3)
    # 16 codes + fp16 scale and bias = 20 of 64 bytes per row
    stored = sum(a.nbytes for a in encode_table(values, "int8").values())
    assert stored / values.nbytes == 20 / 64
    assert encode_table(values, "fp16")["values"].nbytes / values.nbytes == 0.5


def test_int8_export_serves_close_to_fp32(trained, exported, cli, tmp_path):
    out = tmp_path / "ctr8"
    cli("export", "--run", str(trained.run), "--out", str(out), "--precision", "int8")
    manifest = json.loads((out / "1" / "manifest.json").read_text())
    assert manifest["precision"] == "int8" and manifest["name"] == "ctr8"
    fp32, int8 = ServedModel(exported), ServedModel(out)
    lines = [line for line in trained.raw.read_text().split("\n") if line][:2000]
    ids, dense = fp32.encode_rows(lines[:1000])
    exact, _ = fp32.predict(ids, dense)
    approximate, _ = int8.predict(ids, dense)
    assert 0 < np.max(np.abs(exact - approximate)) < 0.02
    table = next(iter(fp32.tables))
    assert int8.tables[table].values.nbytes * 4 == fp32.tables[table].values.nbytes
    assert isinstance(int8.tables[table].values, np.memmap)  # served from disk
    fp32.close()
    int8.close()
