"""bench/sim_validate.py's one command, dry: every bin/bench run it would start is replaced by
a simulated "measurement" of the same command (a known cost model with noise, written in
bin/bench's JSON layout), so the calibration, the workloads rebuilt from the runs' records,
the replay and the pass/fail table are exercised in seconds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from conveyor.profiling import STEP_SHAPE_SERIES, plan_shape
from conveyor.runtime.config import SchedulerConfig
from conveyor_tools.bench.workloads import make_workload
from conveyor_tools.cli.bench_options import build_parser
from conveyor_tools.sim import validate
from conveyor_tools.sim.cost import StepCost
from conveyor_tools.sim.simulator import SimRequest, simulate

TRUE_COST = StepCost(
    0.004,
    {"prefill_tokens": 8e-5, "decode_seqs": 3e-4, "context_tokens": 5e-7, "prefill_attention": 2e-8,
     "decode_classes": 4e-4,
     "peak_tokens": 1e-4},
)  # fmt: skip
VOCAB, MAX_LEN, BLOCKS = 4096, 2048, 4096


def fake_bench(slow: dict[str, float]):
    """A stand-in for one bin/bench offline run: parses the command with bin/bench's own
    parser, serves its workload in the simulator with :data:`TRUE_COST` times 3 % noise
    (times ``slow[workload]``), and writes what bin/bench writes that the validation reads."""
    rng = np.random.default_rng(0)
    commands: list[list[str]] = []

    def measure(command: list[str], json_path: Path) -> None:
        commands.append(command)
        assert command[1:4] == ["-m", "conveyor_tools.cli.bench", "offline"]
        args = build_parser().parse_args(command[3:])
        assert args.systems == "conveyor" and args.threads == 1 and args.json == str(json_path)
        wl = make_workload(args.workload, args.num_requests, seed=args.seed, vocab_size=VOCAB, max_model_len=MAX_LEN,
                           prompt_len=args.prompt_len, output_len=args.output_len, min_len=args.min_len,
                           max_len=args.max_len, scale=args.scale, output_sigma=args.output_sigma)  # fmt: skip
        config = SchedulerConfig(num_blocks=BLOCKS, max_num_seqs=args.batch_size,
                                 max_num_batched_tokens=args.max_batched_tokens,
                                 max_model_len=MAX_LEN)  # fmt: skip
        factor = slow.get(args.workload, 1.0)
        # As a server takes them in: the first request alone, the rest while its step runs.
        reqs = [SimRequest(0.0005 if i else 0.0, r.prompt_ids, r.output_len, str(i)) for i, r in enumerate(wl.requests)]
        price = TRUE_COST.pricer()
        result = simulate(reqs, config, lambda p: price(p) * factor * rng.lognormal(0, 0.03))
        steps = result.replicas[0].steps
        records = {name: [float(plan_shape(s.plan)[i]) for s in steps] for i, name in enumerate(STEP_SHAPE_SERIES)}
        records["step_time"] = [(s.end - s.start) * 1e3 for s in steps]
        summary = result.summary()
        run = {
            "workload": wl.describe(),
            "settings": {
                "model_config": {"vocab_size": VOCAB},
                "max_model_len": MAX_LEN,
                "batch_size": args.batch_size,
                "max_batched_tokens": args.max_batched_tokens,
            },  # fmt: skip
            "systems": {
                "conveyor": {
                    "runs": [{"output_tok_s": summary["output_tok_s"], "ttft_s": summary["ttft_s"]}],
                    "extra": {"step_records": {**records, "num_blocks": BLOCKS}},
                }
            },  # fmt: skip
        }
        json_path.write_text(json.dumps(run))

    return measure, commands


ARGV = ["--batch-sizes", "2,4", "--num-requests", "6", "--calibration-requests", "8"]


def test_one_command_measures_calibrates_and_passes_a_faithful_simulator(tmp_path, capsys):
    measure, commands = fake_bench({})
    assert validate.main(["run", "--out", str(tmp_path), *ARGV], measure=measure) == 0
    # Calibration first at each batch size, then the three validated workloads.
    order = [(c[c.index("--workload") + 1], c[c.index("--batch-size") + 1]) for c in commands]
    assert order == [(w, b) for b in ("2", "4") for w in ("uniform", "lognormal", "fixed", "sharegpt", "high-variance")]
    result = json.loads((tmp_path / "validation.json").read_text())
    assert [(r["workload"], r["batch"]) for r in result["rows"]] == [(w, b) for b in (2, 4) for w in validate.VALIDATED]
    assert result["cells"] == result["cells_passed"] == 18 and result["worst_error"] < 0.15
    for row in result["rows"]:
        assert abs(row["cost_error"]) < 0.1 and row["steps"]["measured"] == row["steps"]["simulated"]
    # Fitted on the calibration runs alone, the model finds the true decode cost.
    coef = result["cost_model"]["coef_s"]
    assert coef["decode_seqs"] == pytest.approx(3e-4, rel=0.15) and coef["decode_classes"] == pytest.approx(
        4e-4, rel=0.25
    )
    table = (tmp_path / "validation.md").read_text()
    assert sum(line.startswith("| ") for line in table.splitlines()) == 7 and "18 of 18 cells within 15%" in table
    assert "[10/10] high-variance-b4" in capsys.readouterr().out
    assert set(json.loads((tmp_path / "loads.json").read_text())) == {
        f"{w}-b{b}" for b in (2, 4) for w in validate.WORKLOAD_ARGS
    }


def test_a_cell_off_by_more_than_the_tolerance_fails_and_evaluate_refits_in_place(tmp_path):
    measure, _ = fake_bench({"high-variance": 1.5})  # the server is slower on it than the model says
    argv = ["--batch-sizes", "3", "--num-requests", "6", "--calibration-requests", "8"]
    assert validate.main(["run", "--out", str(tmp_path), *argv], measure=measure) == 1
    rows = json.loads((tmp_path / "validation.json").read_text())["rows"]
    for row in rows:
        hv = row["workload"] == "high-variance"
        assert row["pass"]["output_tok_s"] != hv and (row["cost_error"] < -0.25) == hv
    assert "**x**" in (tmp_path / "validation.md").read_text()
    # evaluate reuses the measured runs: same table without measuring again.
    (tmp_path / "validation.json").unlink()
    assert validate.main(["evaluate", str(tmp_path), "--batch-sizes", "3"]) == 1
    assert json.loads((tmp_path / "validation.json").read_text())["rows"] == rows


def test_replay_refuses_a_run_whose_workload_it_cannot_rebuild(tmp_path):
    measure, _ = fake_bench({})
    path = tmp_path / "fixed-b2.json"
    measure(validate.bench_command("fixed", 2, 4, 1, path), path)
    run = json.loads(path.read_text())
    run["workload"]["params"]["prompt_len"] = 65  # not what was sent
    model = validate.CostModel({1: TRUE_COST})
    with pytest.raises(ValueError, match="not the run's"):
        validate.replay(run, model)


def test_a_failed_bench_run_stops_the_validation_with_its_log(tmp_path):
    command = [sys.executable, "-c", "import sys; print('server could not start'); sys.exit(3)"]
    with pytest.raises(SystemExit, match="server could not start"):
        validate.measure(command, tmp_path / "fixed-b8.json")
    assert (tmp_path / "fixed-b8.log").exists()
