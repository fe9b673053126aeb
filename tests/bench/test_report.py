"""bin/bench's own output: the offline table's columns, and --plot refused before a run when it cannot work."""

from __future__ import annotations

import sys

import pytest

from conveyor_tools.bench import report
from conveyor_tools.cli import bench


def offline_result(output_tok_s: float) -> dict:
    summary = {
        "output_tok_s": output_tok_s,
        "total_tok_s": 2 * output_tok_s,
        "req_s": 1.0,
        "wall_s": 10.0,
        "latency_s": {"p50": 1.0, "p99": 2.0},
        "mean_batch_occupancy": 4.0,
    }
    return {"runs": [summary], "median": report.aggregate([summary], report.OFFLINE_KEYS)}


def test_offline_table_states_each_ratio_once() -> None:
    table, ratios = report.offline_table({"conveyor": offline_result(300.0), "hf": offline_result(100.0)})
    header, _, conveyor_row, hf_row = table.splitlines()
    assert "conveyor speedup" in header and "x conveyor" not in header
    assert conveyor_row.split()[-2:] == ["1.00x", "-%"]
    assert hf_row.split()[-2:] == ["3.00x", "-%"]
    assert ratios["hf"] == {"throughput_vs_conveyor": 100.0 / 300.0, "conveyor_speedup": 3.0}


def test_offline_table_names_a_speculating_system_s_acceptance() -> None:
    spec = offline_result(200.0)
    spec["runs"][0].update(spec_acceptance_rate=0.75, spec_mean_acceptance_length=3.5)
    spec["median"] = report.aggregate(spec["runs"], report.OFFLINE_KEYS)
    table, _ = report.offline_table({"conveyor": offline_result(300.0), "conveyor-spec": spec})
    conveyor_row, spec_row = table.splitlines()[2:]
    assert spec_row.endswith("speculation: acceptance 0.75, mean length 3.50")
    assert "speculation" not in conveyor_row


def test_plot_without_matplotlib_is_refused_before_the_run(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec says: not installed

    def no_run(*args, **kwargs):
        raise AssertionError("the benchmark ran although its plots could not be drawn")

    monkeypatch.setattr(bench, "offline", no_run)
    monkeypatch.setattr(bench, "online", no_run)
    assert bench.main(["offline", "--systems", "conveyor", "--plot", str(tmp_path / "plots")]) == 2
    err = capsys.readouterr().err
    assert 'pip install -e ".[bench]"' in err
    assert not (tmp_path / "plots").exists()


def online_summary(output_tok_s: float) -> dict:
    p = {"p50": 0.01, "p90": 0.02, "p99": 0.03, "mean": 0.01}
    return {
        "rate": "inf", "wall_s": 1.0, "num_requests": 4, "num_failed": 0, "output_tokens": 40,
        "output_tok_s": output_tok_s, "req_s": 4.0, "ttft_s": p, "tpot_s": p, "itl_s": p, "e2e_s": p,
        "goodput_req_s": 4.0, "slo_attainment": 1.0,
    }  # fmt: skip


def test_online_ratios_pair_runs_of_the_same_repeat() -> None:
    runs = [
        {"system": "conveyor", "repeat": 0, "summary": online_summary(100.0)},
        {"system": "conveyor-http", "repeat": 0, "summary": online_summary(90.0), "extra": {"cpu_us_per_token": {"http": 40.0}}},
        {"system": "conveyor", "repeat": 1, "summary": online_summary(200.0)},
        {"system": "conveyor-http", "repeat": 1, "summary": online_summary(190.0)},
    ]
    ratios = report.add_online_ratios(runs, "conveyor")
    assert ratios["conveyor-http"]["inf"]["runs"] == [0.9, 0.95]
    assert ratios["conveyor-http"]["inf"]["throughput_vs_conveyor"] == 0.925
    assert ratios["conveyor"]["inf"]["throughput_vs_conveyor"] == 1.0
    table = report.online_table([(r["system"], r["summary"]) for r in runs], "conveyor")
    assert "x conveyor" in table.splitlines()[0] and table.splitlines()[3].split()[-1] == "0.900"
    cpu = report.online_cpu_table(runs).splitlines()
    assert len(cpu) == 3 and cpu[2].split()[:2] == ["conveyor-http", "inf"] and "40.0" in cpu[2]


def test_offline_static_gathers_a_full_batch_and_continuous_does_not() -> None:
    """A plain `bin/bench offline` serves static batching behind the experiments' gate (a full
    batch or a bounded wait), so its first batch never depends on arrival timing."""
    from conveyor.cli import serve
    from conveyor_tools.bench.experiments import OFFLINE_GATE_WAIT_MS

    args = bench.build_parser().parse_args(["offline", "--batch-size", "12"])

    def served(system: str):
        return serve.build_parser().parse_args(bench.offline_serve_args(args, "/model", "cpu", system))

    static, continuous = served("static"), served("conveyor")
    assert (static.batching, static.min_batch_size, static.max_wait_ms) == ("static", 12, OFFLINE_GATE_WAIT_MS)
    assert static.max_num_seqs == 12
    assert (continuous.batching, continuous.min_batch_size, continuous.max_wait_ms) == ("continuous", 1, 0.0)


@pytest.mark.parametrize("flag", ["--controls-fraction", "--constrained-fraction"])
@pytest.mark.parametrize(("systems", "fraction"), [("conveyor,hf", "0.5"), ("conveyor,conveyor-http", "0.5"), ("conveyor", "1.5")])
def test_request_field_fractions_are_refused_before_the_run(monkeypatch, tiny_checkpoint, capsys, flag, systems, fraction) -> None:
    """A fraction outside [0, 1], or a system whose driver cannot send the fields, is refused
    with the flag named, before anything runs."""

    def no_run(*args, **kwargs):
        raise AssertionError("the benchmark ran although its workload was refused")

    monkeypatch.setattr(bench, "offline", no_run)
    argv = ["offline", "--systems", systems, "--model", str(tiny_checkpoint), "--device", "cpu", flag, fraction]
    assert bench.main(argv) == 2
    assert f"bench: {flag} needs a value in [0, 1]" in capsys.readouterr().err
