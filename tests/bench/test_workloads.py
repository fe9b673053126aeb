"""Workloads are seeded and shaped as documented; client-side latency figures are computed right."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conveyor_tools.bench.run_metrics import OnlineRun, StreamTiming, Timeline, percentiles
from conveyor_tools.bench.workloads import (
    HV_LONG,
    HV_SHORT,
    SAMPLING_CONTROLS,
    SHAREGPT_MEAN_OUTPUT,
    SHAREGPT_MEAN_PROMPT,
    make_workload,
    poisson_arrivals,
    with_controls,
    workload_from_args,
)

VOCAB = 4096


def lens(workload) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.array([r.prompt_len for r in workload.requests]),
        np.array([r.output_len for r in workload.requests]),
    )


@pytest.mark.parametrize("name", ["fixed", "uniform", "sharegpt", "high-variance"])
def test_same_seed_same_requests(name) -> None:
    a = make_workload(name, 20, seed=3, vocab_size=VOCAB, max_model_len=4096)
    b = make_workload(name, 20, seed=3, vocab_size=VOCAB, max_model_len=4096)
    c = make_workload(name, 20, seed=4, vocab_size=VOCAB, max_model_len=4096)
    assert a.requests == b.requests
    assert name == "fixed" or a.requests != c.requests
    assert all(10 <= t < VOCAB for r in a.requests for t in r.prompt_ids)


@pytest.mark.parametrize(
    ("flags", "kwargs"),
    [
        (["--workload", "fixed", "--prompt-len", "7", "--output-len", "9"], {"prompt_len": 7, "output_len": 9}),
        (
            ["--workload", "uniform", "--min-len", "5", "--max-len", "12", "--seed", "3"],
            {"min_len": 5, "max_len": 12, "seed": 3},
        ),
        (["--workload", "sharegpt", "--scale", "0.25", "--num-requests", "9"], {"scale": 0.25}),
        (
            ["--workload", "lognormal", "--output-len", "20", "--output-sigma", "0.5"],
            {"output_len": 20, "output_sigma": 0.5},
        ),
    ],
)
def test_bench_and_sim_flags_name_the_same_workload(flags, kwargs) -> None:
    """bin/sim replays bin/bench's requests: the same flags on either command line give the
    workload make_workload gives for those values."""
    from conveyor_tools.cli import bench_options, sim

    bench_args = bench_options.build_parser().parse_args(["offline", *flags])
    sim_args = sim.build_parser().parse_args(["run", "--cost", "unused.json", *flags])
    name, n = flags[1], int(flags[flags.index("--num-requests") + 1]) if "--num-requests" in flags else 64
    want = make_workload(name, n, vocab_size=VOCAB, max_model_len=4096, **kwargs)
    for args in (bench_args, sim_args):
        assert workload_from_args(args, vocab_size=VOCAB, max_model_len=4096).requests == want.requests


def test_fixed_and_uniform_lengths() -> None:
    prompts, outputs = lens(make_workload("fixed", 5, vocab_size=VOCAB, max_model_len=4096, prompt_len=7, output_len=9))
    assert set(prompts) == {7} and set(outputs) == {9}
    prompts, outputs = lens(make_workload("uniform", 500, vocab_size=VOCAB, max_model_len=4096))
    assert prompts.min() >= 100 and prompts.max() <= 1024 and outputs.min() >= 100 and outputs.max() <= 1024


def test_sharegpt_means_follow_the_published_figures() -> None:
    prompts, outputs = lens(make_workload("sharegpt", 20000, vocab_size=VOCAB, max_model_len=4096))
    # mu is solved for the mean after clipping, so the sample means match the paper's.
    assert prompts.mean() == pytest.approx(SHAREGPT_MEAN_PROMPT, rel=0.03)
    assert outputs.mean() == pytest.approx(SHAREGPT_MEAN_OUTPUT, rel=0.03)
    assert prompts.min() >= 4 and outputs.max() <= 1024


def test_high_variance_mixes_short_and_very_long() -> None:
    _, outputs = lens(make_workload("high-variance", 2000, vocab_size=VOCAB, max_model_len=4096))
    short = (outputs >= HV_SHORT[0]) & (outputs <= HV_SHORT[1])
    long = (outputs >= HV_LONG[0]) & (outputs <= HV_LONG[1])
    assert (short | long).all()
    assert long.mean() == pytest.approx(0.2, abs=0.03)


def test_lengths_are_clamped_to_the_model_and_counted() -> None:
    w = make_workload("high-variance", 200, vocab_size=VOCAB, max_model_len=300)
    prompts, outputs = lens(w)
    assert (prompts + outputs <= 300).all() and w.num_clamped > 0 and w.describe()["num_clamped"] == w.num_clamped


def test_poisson_arrivals() -> None:
    arrivals = poisson_arrivals(4000, 8.0, seed=1)
    assert arrivals[0] == 0.0 and all(b >= a for a, b in zip(arrivals, arrivals[1:]))
    assert len(arrivals) / arrivals[-1] == pytest.approx(8.0, rel=0.1)
    assert poisson_arrivals(3, math.inf, seed=1) == [0.0, 0.0, 0.0]


def test_stream_timing_and_goodput() -> None:
    fast = StreamTiming(sent=0.0, token_times=[0.1, 0.2, 0.4], token_counts=[1, 1, 2], finished=0.4, num_tokens=4)
    assert fast.ttft == pytest.approx(0.1) and fast.e2e == pytest.approx(0.4)
    assert fast.tpot == pytest.approx(0.1) and fast.itls() == pytest.approx([0.1, 0.1, 0.1])
    slow = StreamTiming(sent=0.0, token_times=[3.0], token_counts=[1], finished=3.0, num_tokens=1)
    run = OnlineRun("conveyor", 2.0, 4.0, [fast, slow], 5, slo_ttft_s=1.0, slo_tpot_s=0.2)
    s = run.summary()
    assert s["goodput_req_s"] == pytest.approx(0.25) and s["slo_attainment"] == 0.5
    assert s["tpot_s"]["p50"] == pytest.approx(0.1)  # one-token requests have no TPOT


def test_percentiles_and_timeline_means() -> None:
    p = percentiles(list(range(1, 101)))
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)
    assert percentiles([])["p50"] is None
    assert Timeline([0, 1, 2], [4, 2, 0]).mean() == pytest.approx(2.0)
    # A step function holds 4 for 1 s and 2 for 3 s: the time-weighted mean is 2.5.
    assert Timeline([0, 1, 4], [4, 2, 0], step_function=True).mean() == pytest.approx(2.5)


@pytest.mark.parametrize("fraction, expected", [(0.0, 0), (0.5, 10), (0.25, 5), (1.0, 20)])
def test_controls_fraction_spreads_evenly(fraction, expected):
    base = make_workload("fixed", 20, seed=0, vocab_size=100, max_model_len=64, prompt_len=8, output_len=4)
    workload = with_controls(base, fraction)
    marked = [i for i, r in enumerate(workload.requests) if r.sampling]
    assert len(marked) == expected and all(workload.requests[i].sampling == SAMPLING_CONTROLS for i in marked)
    assert abs(sum(1 for i in marked if i < 10) - expected / 2) <= 1  # spread, not bunched at one end
    assert [r.prompt_ids for r in workload.requests] == [r.prompt_ids for r in base.requests]
    assert workload.describe()["params"]["controls_fraction"] == fraction
    with pytest.raises(ValueError):
        with_controls(base, 1.5)


def test_logprobs_fraction_marks_an_even_spread_of_requests() -> None:
    from conveyor_tools.bench.workloads import with_logprobs

    base = make_workload("fixed", 8, vocab_size=100, max_model_len=256, prompt_len=4, output_len=4)
    half = with_logprobs(base, 0.5, 3)
    assert [r.sampling.get("logprobs") for r in half.requests] == [None, 3] * 4
    assert [r.prompt_ids for r in half.requests] == [r.prompt_ids for r in base.requests]
    assert all(r.sampling == {"logprobs": 0} for r in with_logprobs(base, 1.0, 0).requests)
    assert half.describe()["params"]["logprobs_fraction"] == 0.5 and half.describe()["params"]["logprobs"] == 3
    with pytest.raises(ValueError):
        with_logprobs(base, 1.5, 3)


def test_retokenized_keeps_the_shapes_and_sampling_with_fresh_tokens():
    """A warm-up or a second timed run (bin/bench --warmup workload, --timed-runs): the same
    prompt lengths and sampling fields, tokens that share no first block with the original
    (no prefix-cache hit), outputs capped when asked."""
    from conveyor_tools.bench.workloads import retokenized

    base = with_controls(make_workload("high-variance", 12, seed=3, vocab_size=VOCAB, max_model_len=2048), 0.5)
    again = retokenized(base, 4, VOCAB)
    capped = retokenized(base, 4, VOCAB, max_output_len=16)
    assert [r.prompt_len for r in again.requests] == [r.prompt_len for r in base.requests]
    assert [r.output_len for r in again.requests] == [r.output_len for r in base.requests]
    assert [r.sampling for r in again.requests] == [r.sampling for r in base.requests]
    assert [r.output_len for r in capped.requests] == [min(16, r.output_len) for r in base.requests]
    assert [r.prompt_ids for r in capped.requests] == [r.prompt_ids for r in again.requests]  # the seed decides
    firsts = {tuple(r.prompt_ids[:16]) for r in base.requests}
    assert not firsts & {tuple(r.prompt_ids[:16]) for r in again.requests}
    assert all(10 <= t < VOCAB for r in again.requests for t in r.prompt_ids)
