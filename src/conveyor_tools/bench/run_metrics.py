"""What one run of one system measured, and the figures the report derives from it.

Token counts are the workload's: every system is asked for exactly ``output_len`` tokens
per request with EOS ignored, and a run whose outputs differ in length is marked failed
rather than counted. Tokens a padded batch computes past a request's length are waste, not
output, so they are not counted either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from conveyor_tools.bench.workloads import Workload

PERCENTILES = (50, 90, 99)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99/mean of ``values``; None when there are none."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    arr = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(arr, PERCENTILES).tolist()
    return {"p50": p50, "p90": p90, "p99": p99, "mean": float(arr.mean())}


@dataclass
class Timeline:
    """Batch occupancy over time: ``running[i]`` sequences in the batch at ``t_s[i]`` seconds
    after the run started. ``source`` says how it was measured.

    Samples are per step (the mean is then the mean batch size of a step) unless
    ``step_function``: then each value holds until the next sample and the mean is weighted
    by time.
    """

    t_s: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    source: str = ""
    step_function: bool = False

    def mean(self) -> float | None:
        if not self.running:
            return None
        if not self.step_function or len(self.t_s) < 2:
            return float(np.mean(self.running))
        t = np.asarray(self.t_s)
        widths = np.diff(t)
        total = float(t[-1] - t[0])
        return float(np.dot(np.asarray(self.running[:-1]), widths) / total) if total > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "step_function": self.step_function, "t_s": self.t_s, "running": self.running}


@dataclass
class OfflineRun:
    """All requests submitted at t = 0; ``latencies_s[i]`` is request i's completion time."""

    system: str
    wall_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    latencies_s: list[float]
    ttft_s: list[float] = field(default_factory=list)
    timeline: Timeline = field(default_factory=Timeline)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        system: str,
        workload: Workload,
        wall_s: float,
        latencies_s: list[float],
        ttft_s: list[float],
        timeline: Timeline,
        extra: dict[str, Any],
    ) -> OfflineRun:
        """A complete run of ``workload``: its request and token counts are the workload's."""
        return cls(
            system=system,
            wall_s=wall_s,
            num_requests=len(workload.requests),
            prompt_tokens=workload.prompt_tokens,
            output_tokens=workload.output_tokens,
            latencies_s=latencies_s,
            ttft_s=ttft_s,
            timeline=timeline,
            extra=extra,
        )

    def summary(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall_s,
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "output_tok_s": self.output_tokens / self.wall_s,
            "total_tok_s": (self.prompt_tokens + self.output_tokens) / self.wall_s,
            "req_s": self.num_requests / self.wall_s,
            "latency_s": percentiles(self.latencies_s),
            "ttft_s": percentiles(self.ttft_s),
            "mean_batch_occupancy": self.timeline.mean(),
        }


@dataclass
class StreamTiming:
    """One streamed request seen by the client: send time, token arrival times, finish time
    (seconds on the client's clock), and how many tokens each arrival carried."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)
    finished: float = 0.0
    num_tokens: int = 0
    ok: bool = True

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def e2e(self) -> float:
        return self.finished - self.sent

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.num_tokens < 2 or not self.token_times:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.num_tokens - 1)

    def itls(self) -> list[float]:
        """Gaps between consecutive arrivals, spread evenly over the tokens each brought."""
        out = []
        for prev, cur, n in zip(self.token_times, self.token_times[1:], self.token_counts[1:]):
            out.extend([(cur - prev) / n] * n)
        return out


@dataclass
class OnlineRun:
    """Poisson arrivals at ``rate`` requests/s (inf: all at once) against one server."""

    system: str
    rate: float
    wall_s: float
    requests: list[StreamTiming]
    output_tokens: int
    slo_ttft_s: float
    slo_tpot_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        done = [r for r in self.requests if r.ok]
        ttft = [r.ttft for r in done if r.ttft is not None]
        tpot = [r.tpot for r in done if r.tpot is not None]
        itl = [gap for r in done for gap in r.itls()]
        e2e = [r.e2e for r in done]
        good = [
            r
            for r in done
            if r.ttft is not None and r.ttft <= self.slo_ttft_s and (r.tpot is None or r.tpot <= self.slo_tpot_s)
        ]
        return {
            "rate": "inf" if math.isinf(self.rate) else self.rate,
            "wall_s": self.wall_s,
            "num_requests": len(self.requests),
            "num_failed": len(self.requests) - len(done),
            "output_tokens": self.output_tokens,
            "output_tok_s": self.output_tokens / self.wall_s,
            "req_s": len(done) / self.wall_s,
            "ttft_s": percentiles(ttft),
            "tpot_s": percentiles(tpot),
            "itl_s": percentiles(itl),
            "e2e_s": percentiles(e2e),
            "slo": {"ttft_s": self.slo_ttft_s, "tpot_s": self.slo_tpot_s},
            "goodput_req_s": len(good) / self.wall_s,
            "slo_attainment": len(good) / len(self.requests) if self.requests else None,
        }
