"""bin/bench experiments: the figures it derives are computed as documented, and its --quick
run on a tiny checkpoint gives every table with sane numbers (docs/experiments.md)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from conveyor_tools.bench.batch_stats import kv_usage, occupancy, padded_waste
from conveyor_tools.bench.experiments import SPREADS
from conveyor_tools.bench.workloads import SHAREGPT_MEAN_OUTPUT, BenchRequest, Workload, make_workload
from conveyor_tools.cli import bench
from tests.e2e.serve_harness import REPO

VOCAB = 4096


def workload(*pairs: tuple[int, int]) -> Workload:
    return Workload("test", 0, [BenchRequest([10] * p, o) for p, o in pairs])


def test_padded_waste_is_the_rectangle_minus_the_tokens() -> None:
    # Batch 1: rows of 2+3 and 4+1 tokens padded to 4+3 each: 14 slots, 10 tokens.
    # Batch 2: one row, no padding.
    waste = padded_waste(workload((2, 3), (4, 1), (1, 1)), batch_size=2)
    assert waste == {"num_batches": 2, "peak_waste_tokens": 4, "total_waste_tokens": 4, "fraction": 4 / 16}
    assert padded_waste(workload((5, 5), (5, 5)), batch_size=2)["total_waste_tokens"] == 0


def row(step: int, t: float, held: int, context: int) -> dict:
    return {"step": step, "time": t, "held_blocks": held, "context_tokens": context}


def test_kv_usage_weights_each_step_by_its_time() -> None:
    rows = [row(1, 9.0, 50, 0), row(2, 10.0, 2, 20), row(3, 11.0, 4, 60), row(4, 14.0, 0, 0), row(5, 16.0, 9, 9)]
    kv = kv_usage(rows, start=10.0, end=15.0, block_size=16)
    # Held 2 for 1 s, 4 for 3 s, 0 for the last 1 s; rows outside the window are left out.
    assert kv["avg_held_blocks"] == pytest.approx(2.8) and kv["peak_held_blocks"] == 4
    # Slack: 2*16-20 = 12 for 1 s, 4*16-60 = 4 for 3 s, 0 for 1 s.
    assert kv["avg_slack_tokens"] == pytest.approx(24 / 5) and kv["peak_slack_tokens"] == 12
    assert kv["coverage"] == 1.0 and kv["series"]["t_s"] == [0.0, 1.0, 4.0]
    gappy = kv_usage([rows[1], rows[3]], start=10.0, end=15.0, block_size=16)
    assert gappy["coverage"] == pytest.approx(2 / 3)
    assert not kv_usage(rows, start=20.0, end=30.0, block_size=16)["available"]


def test_occupancy_per_step_and_over_time() -> None:
    occ = occupancy({"t_s": [0.0, 1.0, 4.0], "running": [4, 2, 0]}, batch_size=4)
    assert occ["mean_per_step"] == pytest.approx(2.0) and occ["fraction_per_step"] == pytest.approx(0.5)
    assert occ["mean_over_time"] == pytest.approx(2.5) and occ["fraction_over_time"] == pytest.approx(2.5 / 4)
    assert not occupancy({"t_s": [], "running": [], "source": "unavailable: --no-profile"}, 4)["available"]


@pytest.mark.parametrize("sigma", [0.0, *SPREADS.values()])
def test_lognormal_workload_keeps_its_mean_at_every_spread(sigma) -> None:
    w = make_workload(
        "lognormal", 4000, vocab_size=VOCAB, max_model_len=8192, prompt_len=32, output_len=64, output_sigma=sigma
    )
    outputs = np.array([r.output_len for r in w.requests])
    assert {r.prompt_len for r in w.requests} == {32}
    assert outputs.mean() == pytest.approx(64, rel=0.05)
    assert outputs.min() >= 1 and outputs.max() <= 16 * 64
    if sigma == 0:
        assert set(outputs) == {64}


def test_lognormal_spreads_are_ordered() -> None:
    cvs = []
    for sigma in SPREADS.values():
        w = make_workload("lognormal", 2000, vocab_size=VOCAB, max_model_len=8192, output_len=64, output_sigma=sigma)
        outputs = np.array([r.output_len for r in w.requests])
        cvs.append(outputs.std() / outputs.mean())
    assert cvs == sorted(cvs) and cvs[0] < 0.3 and cvs[-1] > 1.0


def test_sharegpt_scale_shrinks_the_means() -> None:
    w = make_workload("sharegpt", 20000, vocab_size=VOCAB, max_model_len=4096, scale=0.25)
    outputs = np.array([r.output_len for r in w.requests])
    assert outputs.mean() == pytest.approx(SHAREGPT_MEAN_OUTPUT * 0.25, rel=0.03) and outputs.max() <= 256


def test_only_takes_experiment_numbers(capsys) -> None:
    assert bench.main(["experiments", "--only", "1,6"]) == 2
    assert "--only" in capsys.readouterr().err


def run_experiments(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "bin" / "bench"), "experiments", "--no-progress", "--threads", "1", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_quick_run_gives_every_table(tiny_checkpoint, tmp_path) -> None:
    proc = run_experiments(
        "--quick", "--model", str(tiny_checkpoint), "--kv-cache-memory", "0.01", "--out", str(tmp_path)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "experiments.json").read_text())
    assert result["environment"]["machine"]["cpu"] and result["environment"]["device"]["kind"] == "cpu"
    tables = result["tables"]
    assert set(tables) == {"1_throughput", "2_latency", "3_occupancy", "4_kv", "5_variance"}
    assert not result["unavailable"]

    rows = tables["1_throughput"]["rows"]
    assert [r["batch_size"] for r in rows] == [2, 4]
    for r in rows:
        assert positive(r["continuous_tok_s"]) and positive(r["static_tok_s"]) and positive(r["ratio"])

    lat = tables["2_latency"]
    assert positive(lat["rate_req_s"])
    for r in lat["rows"]:
        assert positive(r["continuous_s"]) and positive(r["static_s"]) and positive(r["ratio"])
    assert [r["continuous_s"] for r in lat["rows"]] == sorted(r["continuous_s"] for r in lat["rows"])

    for system in ("continuous", "static"):
        occ = tables["3_occupancy"][system]
        assert 0 < occ["fraction_per_step"] <= 1 and 0 < occ["fraction_over_time"] <= 1
        kv = tables["4_kv"][system]
        assert 0 < kv["avg_held_blocks"] <= kv["peak_held_blocks"] and kv["coverage"] > 0.9
        assert 0 <= kv["avg_slack_tokens"] <= kv["peak_slack_tokens"]
    # Continuous batching keeps its batch fuller than static batching does.
    assert tables["3_occupancy"]["continuous"]["mean_over_time"] > tables["3_occupancy"]["static"]["mean_over_time"]
    pad = tables["4_kv"]["padded_static"]
    assert pad["peak_waste_tokens"] > 0 and 0 < pad["fraction"] < 1

    spreads = tables["5_variance"]["rows"]
    assert [r["spread"] for r in spreads] == list(SPREADS)
    for r in spreads:
        assert positive(r["continuous_tok_s"]) and positive(r["static_tok_s"]) and positive(r["output_len_cv"])
    assert [r["output_len_cv"] for r in spreads] == sorted(r["output_len_cv"] for r in spreads)

    text = (tmp_path / "tables.txt").read_text()
    for heading in ("1. Throughput", "2. End-to-end latency", "3. Batch occupancy", "4. KV cache", "5. Output-length"):
        assert heading in text and heading in proc.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        for name in ("1_throughput", "2_latency", "3_occupancy", "4_kv_blocks", "5_variance"):
            assert (tmp_path / f"{name}.png").stat().st_size > 1000


def test_a_system_that_cannot_run_is_reported_with_its_reason(tiny_checkpoint, tmp_path) -> None:
    proc = run_experiments(
        "--only", "1", "--batch-sizes", "2", "--model", str(tiny_checkpoint), "--serve-arg=--no-such-flag",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 1
    result = json.loads((tmp_path / "experiments.json").read_text())
    row = result["tables"]["1_throughput"]["rows"][0]
    assert row["continuous_tok_s"] is None and row["ratio"] is None and "did not become ready" in row["unavailable"]
    assert "n/a:" in proc.stdout
