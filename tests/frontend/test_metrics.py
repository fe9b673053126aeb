"""The frontend's request-level metrics (conveyor.frontend.request_metrics): bucket counts against
references computed by hand, the batched inter-token path against per-token observation, and
what a finished request adds."""

from __future__ import annotations

import random

import numpy as np
import pytest

from conveyor.frontend import request_metrics as fm
from conveyor.frontend.request_metrics import FrontendMetrics, Histogram

MS = 1_000_000  # ns


def per_token_counts(bounds_s: tuple[float, ...], gaps_ns: list[int]) -> list[int]:
    """The reference: each gap on its own, in the bucket of the first bound it does not exceed."""
    counts = [0] * (len(bounds_s) + 1)
    for gap in gaps_ns:
        index = len(bounds_s)
        for i, bound in enumerate(bounds_s):
            if gap <= round(bound * 1e9):
                index = i
                break
        counts[index] += 1
    return counts


def test_values_fall_in_the_bucket_of_the_first_bound_they_do_not_exceed() -> None:
    hist = Histogram((0.01, 0.1, 1.0))
    for value in (0.0, 0.005, 0.01, 0.0100001, 0.1, 0.5, 1.0, 2.0):
        hist.observe(value)
    # le 0.01: 0, 0.005, 0.01 | le 0.1: 0.0100001, 0.1 | le 1: 0.5, 1.0 | +Inf: 2.0
    assert hist.counts == [3, 2, 2, 1]
    assert hist.count == 8 and hist.sum == pytest.approx(3.6250001)

    batched = Histogram((0.01, 0.1, 1.0))
    batched.observe_ns(np.array([0, 5 * MS, 10 * MS, 10 * MS + 100, 100 * MS, 500 * MS, 1000 * MS, 2000 * MS]))
    assert batched.counts == [3, 2, 2, 1]
    assert batched.count == 8 and batched.sum == pytest.approx(3.6250001)
    batched.observe_ns(np.array([], dtype=np.int64))
    batched.observe_zeros(2)
    assert batched.to_map() == {"buckets": [0.01, 0.1, 1.0], "counts": [5, 2, 2, 1], "sum": batched.sum, "count": 10}


@pytest.mark.parametrize("bounds", [(), (0.1, 0.1), (1.0, 0.5)])
def test_bounds_must_increase(bounds) -> None:
    with pytest.raises(ValueError, match="increasing"):
        Histogram(bounds)


def test_the_bucket_bounds_increase_from_milliseconds_to_minutes() -> None:
    for bounds in (fm.TIME_TO_FIRST_TOKEN_BUCKETS_S, fm.TOKEN_GAP_BUCKETS_S, fm.REQUEST_LATENCY_BUCKETS_S):
        assert list(bounds) == sorted(set(bounds))
        assert bounds[0] <= 0.01 and bounds[-1] >= 60


def test_batched_gaps_count_as_per_token_observation() -> None:
    """Calls' previous-output times (0: a stream's first output), held back and bucketed
    together (when enough are held, and at each snapshot) give the counts, sum and number of
    observing each gap alone; first outputs add tokens, no gap."""
    rng = random.Random(7)
    metrics = FrontendMetrics()
    bounds = fm.TOKEN_GAP_BUCKETS_S
    now = 10**12
    expected_gaps: list[int] = []
    tokens = 0
    for _ in range(40):
        now += rng.randrange(1, 200 * MS)
        on_bounds = [now - round(b * 1e9) for b in rng.sample(bounds, 3)]  # gaps exactly on a bound
        size = rng.choice([1, 5, 300, fm.BUCKET_EVERY])
        previous = [0 if rng.random() < 0.1 else now - rng.randrange(0, 3_000 * MS) for _ in range(size)]
        previous += on_bounds + [0]
        metrics.observe_outputs(previous, now)
        expected_gaps += [now - p for p in previous if p]
        tokens += len(previous)
        if rng.random() < 0.2:  # a scrape in between: exact so far
            assert metrics.snapshot()["histograms"]["inter_token_latency_seconds"]["count"] == len(expected_gaps)
    metrics.flush()
    itl = metrics.itl
    assert itl.counts == per_token_counts(bounds, expected_gaps)
    assert itl.count == len(expected_gaps) == sum(itl.counts)
    assert itl.sum == pytest.approx(sum(expected_gaps) / 1e9)
    assert metrics.generation_tokens == tokens


def test_tokens_delivered_together_add_gaps_of_zero() -> None:
    metrics = FrontendMetrics()
    metrics.observe_outputs([0], 5 * MS)  # a first token: no gap
    metrics.observe_together(2)  # two more in the same output
    metrics.observe_outputs([5 * MS], 25 * MS)  # 20 ms later
    metrics.flush()
    itl = metrics.itl
    assert metrics.generation_tokens == 4
    assert itl.count == 3 and itl.sum == pytest.approx(0.02)  # n - 1 gaps, summing to first-to-last
    assert itl.counts[0] == 2 and itl.counts[bounds_index(fm.TOKEN_GAP_BUCKETS_S, 0.02)] == 1


def bounds_index(bounds: tuple[float, ...], value: float) -> int:
    return next(i for i, b in enumerate(bounds) if value <= b)


def test_a_finished_request_adds_its_reason_and_latencies() -> None:
    metrics = FrontendMetrics()
    metrics.add_prompt(7)
    metrics.request_finished("length", {"queue_time": 0.003, "ttft": 0.05, "total": 0.45}, 5)
    metrics.request_finished("stop", {"queue_time": None, "ttft": 0.2, "total": 0.2}, 1)  # one token: no TPOT
    metrics.request_finished("abort", {"queue_time": None, "ttft": None, "total": 0.01}, 0)
    metrics.request_finished("abort", None, 3)  # a gone client: counted, no latencies
    snap = metrics.snapshot()
    assert snap["counters"] == {
        "prompt_tokens": 7,
        "generation_tokens": 0,
        "request_success": {"stop": 1, "length": 1, "abort": 2, "error": 0},
        "clients_not_reading": 0,
    }
    hists = snap["histograms"]
    assert set(hists) == {
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_params_max_tokens",
    }
    for hist in hists.values():
        assert len(hist["counts"]) == len(hist["buckets"]) + 1 and sum(hist["counts"]) == hist["count"]
    ttft, tpot = hists["time_to_first_token_seconds"], hists["time_per_output_token_seconds"]
    assert (ttft["count"], ttft["sum"]) == (2, pytest.approx(0.25))
    assert (tpot["count"], tpot["sum"]) == (1, pytest.approx(0.1))  # (0.45 - 0.05) / 4
    assert tpot["counts"][bounds_index(fm.TOKEN_GAP_BUCKETS_S, 0.1)] == 1
    e2e, queue = hists["e2e_request_latency_seconds"], hists["request_queue_time_seconds"]
    assert (e2e["count"], e2e["sum"]) == (3, pytest.approx(0.66))
    assert (queue["count"], queue["sum"]) == (1, pytest.approx(0.003))
    assert queue["counts"][bounds_index(fm.QUEUE_TIME_BUCKETS_S, 0.003)] == 1
    prefill, decode = hists["request_prefill_time_seconds"], hists["request_decode_time_seconds"]
    assert (prefill["count"], prefill["sum"]) == (1, pytest.approx(0.047))  # only the one with a queue time
    assert (decode["count"], decode["sum"]) == (2, pytest.approx(0.4))  # 0.45 - 0.05, and 0.2 - 0.2
    assert hists["request_inference_time_seconds"]["sum"] == pytest.approx(0.447)
    assert hists["request_prompt_tokens"]["count"] == 0  # none was given its prompt size

    snap["counters"]["request_success"]["stop"] = 99  # a snapshot is a copy
    snap["histograms"]["e2e_request_latency_seconds"]["counts"][0] = 99
    again = metrics.snapshot()
    assert again["counters"]["request_success"]["stop"] == 1
    assert again["histograms"]["e2e_request_latency_seconds"]["counts"][0] == 0
