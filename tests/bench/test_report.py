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
        {
            "system": "conveyor-http",
            "repeat": 0,
            "summary": online_summary(90.0),
            "extra": {"cpu_us_per_token": {"http": 40.0}},
        },
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
@pytest.mark.parametrize(
    ("systems", "fraction"), [("conveyor,hf", "0.5"), ("conveyor,conveyor-http", "0.5"), ("conveyor", "1.5")]
)
def test_request_field_fractions_are_refused_before_the_run(
    monkeypatch, tiny_checkpoint, capsys, flag, systems, fraction
) -> None:
    """A fraction outside [0, 1], or a system whose driver cannot send the fields, is refused
    with the flag named, before anything runs."""

    def no_run(*args, **kwargs):
        raise AssertionError("the benchmark ran although its workload was refused")

    monkeypatch.setattr(bench, "offline", no_run)
    argv = ["offline", "--systems", systems, "--model", str(tiny_checkpoint), "--device", "cpu", flag, fraction]
    assert bench.main(argv) == 2
    assert f"bench: {flag} needs a value in [0, 1]" in capsys.readouterr().err


def test_repeats_show_min_median_max_under_the_throughput_column() -> None:
    runs = [dict(offline_result(v)["runs"][0]) for v in (290.0, 300.0, 330.0)]
    repeated = {"runs": runs, "median": report.aggregate(runs, report.OFFLINE_KEYS)}
    table, _ = report.offline_table({"conveyor": repeated, "hf": offline_result(100.0)})
    header, _, conveyor_row, hf_row = table.splitlines()
    column_end = header.index("out tok/s min/med/max") + len("out tok/s min/med/max")
    cell = "290.0/300.0/330.0"
    assert conveyor_row.index(cell) + len(cell) == column_end  # right-aligned under its own header
    assert hf_row[:column_end].split()[-1] == "100.0/100.0/100.0"
    assert conveyor_row.split()[-2:] == ["1.00x", "-%"]  # nothing trails the last column


def test_a_run_too_short_to_compare_says_so_and_the_minimum() -> None:
    warning = report.too_short(16, 32, {"conveyor": 2.1, "hf-cb": 30.0})
    assert warning.startswith("warning:") and "\n" not in warning
    assert "16 requests" in warning and f"--num-requests {report.MIN_BATCHES * 32}" in warning
    assert "conveyor 2.1 s" in warning and "hf-cb" not in warning and f"{report.MIN_WALL_S:g} s" in warning
    assert report.too_short(4 * 32, 32, {"conveyor": 12.0}) is None


def test_the_progress_bar_starts_after_the_server_is_up(monkeypatch, tiny_checkpoint) -> None:
    """A bar made before the server started would count its start-up in the rate and ETA."""
    import contextlib

    events: list[str] = []

    class Server:
        def __init__(self, args) -> None:
            self.address = "ipc://unused"

        def __enter__(self):
            events.append("server up")
            return self

        def __exit__(self, *exc) -> None:
            events.append("server down")

    @contextlib.contextmanager
    def bar(args, total, desc):
        events.append("bar")
        yield None

    class Run:
        latencies_s, extra = [1.0], {}

        class timeline:
            @staticmethod
            def to_json():
                return {"t_s": []}

        @staticmethod
        def summary():
            return offline_result(100.0)["runs"][0]

    async def run_offline(*args, **kwargs):
        events.append("run")
        return Run()

    monkeypatch.setattr(bench, "BenchServer", Server)
    monkeypatch.setattr(bench, "progress_bar", bar)
    monkeypatch.setattr(bench, "run_offline", run_offline)
    args = bench.build_parser().parse_args(["offline", "--systems", "conveyor", "--model", str(tiny_checkpoint)])
    workload = type("W", (), {"requests": [None] * 8, "name": "fixed", "seed": 0, "params": {}})()
    result = bench.offline(
        args,
        {
            "workload": workload,
            "systems": ["conveyor"],
            "device": "cpu",
            "model_dir": str(tiny_checkpoint),
            "vocab_size": 100,
        },
    )
    assert events == ["server up", "bar", "run", "server down"]
    assert result["warning"].startswith("warning: this run is too short")


def test_plots_show_the_spread_of_repeats(tmp_path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.container import ErrorbarContainer

    from conveyor_tools.bench import plots

    drawn = {}
    real_save = plots._save

    def keep(fig, path, plt):
        drawn[path.name] = [c for ax in fig.axes for c in ax.containers if isinstance(c, ErrorbarContainer)]
        return real_save(fig, path, plt)

    monkeypatch.setattr(plots, "_save", keep)
    runs = [dict(offline_result(v)["runs"][0]) for v in (290.0, 300.0, 330.0)]
    system = {
        "runs": runs,
        "median": report.aggregate(runs, report.OFFLINE_KEYS),
        "latencies_s": [1.0],
        "timeline": {"t_s": []},
    }
    plots.plot_offline(str(tmp_path), "t", {"conveyor": system})
    assert len(drawn["throughput.png"]) == 1
    online = [
        {"system": "conveyor", "repeat": i, "summary": online_summary(v), "raw": {"ttft_s": [0.1], "e2e_s": [1.0]}}
        for i, v in enumerate((90.0, 100.0, 120.0))
    ]
    plots.plot_online(str(tmp_path), "t", online)
    [bars] = drawn["online_throughput.png"]
    assert bars.lines[0].get_ydata().tolist() == [100.0]  # the median, with the min-max range around it


def test_online_repeats_show_min_median_max_per_system_and_rate() -> None:
    runs = [
        {"system": "conveyor", "repeat": i, "summary": online_summary(v)} for i, v in enumerate((120.0, 100.0, 90.0))
    ]
    runs.append({"system": "vllm-cpu", "repeat": 0, "summary": online_summary(80.0)})
    header, _, conveyor, vllm = report.online_spread_table(runs).splitlines()
    assert "min/med/max" in header
    assert conveyor.split() == ["conveyor", "inf", "3", "90.0/100.0/120.0", "30.0/30.0/30.0"]
    assert vllm.split() == ["vllm-cpu", "inf", "1", "80.0/80.0/80.0", "30.0/30.0/30.0"]
    assert report.online_spread_table(runs[:1]) == ""  # one run each: the per-run table says it all
