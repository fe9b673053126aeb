"""bench/decode_step.py runs its tiny --smoke mode on CPU and writes every field the GPU
report reads (step time, roofline, HF, launches and operators per step)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_decode_step_bench_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("decode_step_bench", REPO / "bench" / "decode_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "decode-step.json"
    bench.main(["--smoke", "--device", "cpu", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["copy_bandwidth_gbps"] > 0 and result["versions"]["torch"]
    assert [(r["batch"], r["context"], r["graphs"]) for r in result["rows"]] == [(1, 32, False), (4, 32, False)]
    for row in result["rows"]:
        assert row["median_ms"] > 0 and row["roofline_ms"] > 0 and row["hf_ms"] > 0
        assert row["torch_ops_per_step"] > 0 and row["kernel_launches_per_step"] == 0  # no CUDA here


def test_decode_step_bench_reuses_a_written_checkpoint(tmp_path):
    """--checkpoint: the grid runs on the directory given (bench/gpu_checks.py builds it once)
    and its config.json is the model; the JSON holds the rows."""
    spec = importlib.util.spec_from_file_location("decode_step_bench", REPO / "bench" / "decode_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import torch

    config = {**bench.MODEL_SMOKE, "num_hidden_layers": 3}
    bench.write_checkpoint(config, torch.float32, tmp_path / "ck", tokenizer=True)
    assert (tmp_path / "ck" / "tokenizer.json").exists()
    out = tmp_path / "step.json"
    argv = [
        "--checkpoint",
        str(tmp_path / "ck"),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--batches",
        "2",
        "--contexts",
        "16",
        "--steps",
        "2",
        "--no-hf",
        "--out",
        str(out),
    ]
    bench.main(argv)
    result = json.loads(out.read_text())
    assert result["config"]["num_hidden_layers"] == 3
    assert [(r["batch"], r["context"]) for r in result["rows"]] == [(2, 16)]
