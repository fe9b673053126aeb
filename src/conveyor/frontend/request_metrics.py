"""Request-level metrics the frontend keeps: token and finish counters, latency histograms.

How and why: docs/architecture.md, "Request metrics"."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from conveyor.ipc.messages import FinishReason

# Bucket upper bounds in seconds, each list increasing: milliseconds to minutes, the ranges
# operators see from other servers. Written once here; the reply carries them.
TIME_TO_FIRST_TOKEN_BUCKETS_S = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
    640.0,
)
TOKEN_GAP_BUCKETS_S = (  # time per output token and inter-token latency
    0.001,
    0.002,
    0.005,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS_S = (  # end-to-end latency
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    45.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)
QUEUE_TIME_BUCKETS_S = TIME_TO_FIRST_TOKEN_BUCKETS_S  # an idle server queues for microseconds, a loaded one for minutes
PHASE_TIME_BUCKETS_S = REQUEST_LATENCY_BUCKETS_S  # prefill, decode and inference time of a request
# Token-count bounds (1-2-5 steps up to a million), for prompt, output and max_tokens per request.
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)

# Names of the counters and histograms in the ``metrics`` reply (the Prometheus names are
# these with the ``conveyor:`` prefix; counters get ``_total``).
PROMPT_TOKENS = "prompt_tokens"
GENERATION_TOKENS = "generation_tokens"
REQUEST_SUCCESS = "request_success"
CLIENTS_NOT_READING = "clients_not_reading"
TIME_TO_FIRST_TOKEN = "time_to_first_token_seconds"
TIME_PER_OUTPUT_TOKEN = "time_per_output_token_seconds"
INTER_TOKEN_LATENCY = "inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "request_queue_time_seconds"
REQUEST_PREFILL_TIME = "request_prefill_time_seconds"
REQUEST_DECODE_TIME = "request_decode_time_seconds"
REQUEST_INFERENCE_TIME = "request_inference_time_seconds"
REQUEST_PROMPT_TOKENS = "request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "request_generation_tokens"
REQUEST_MAX_TOKENS = "request_params_max_tokens"
FINISH_REASONS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT, FinishReason.ERROR)
# Outputs held back before their inter-token gaps are bucketed (one numpy pass): bounds the
# memory held (8 bytes an output, plus the lists' own) and the one pass's time (~0.1 ms).
BUCKET_EVERY = 4096


class Histogram:
    """Bucket counts over fixed upper bounds (seconds), their sum and their number.

    ``observe`` takes one value in seconds (per request: rare); ``observe_ns`` a numpy array
    of nanosecond values at once (the per-token path), compared with the bounds in integer
    nanoseconds, so a value exactly on a bound falls in that bound's bucket either way.
    ``counts`` is a plain list of ints.
    """

    __slots__ = ("bounds", "counts", "sum", "count", "_bounds_ns")

    def __init__(self, bounds_s: Sequence[float]) -> None:
        bounds = tuple(float(b) for b in bounds_s)
        if not bounds or any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"bucket bounds must be a non-empty increasing sequence, got {bounds_s!r}")
        self.bounds = bounds
        self._bounds_ns = np.array([round(b * 1e9) for b in bounds], dtype=np.int64)
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value_s: float) -> None:
        """One value in seconds: the bucket of the first bound >= it."""
        self.counts[bisect.bisect_left(self.bounds, value_s)] += 1
        self.sum += value_s
        self.count += 1

    def observe_ns(self, values_ns: np.ndarray) -> None:
        """Many values in integer nanoseconds (int64, >= 0), bucketed in one pass."""
        if not values_ns.size:
            return
        buckets = np.searchsorted(self._bounds_ns, values_ns, side="left")
        added = np.bincount(buckets, minlength=len(self.counts)).tolist()
        self.counts = [have + new for have, new in zip(self.counts, added)]
        self.sum += int(values_ns.sum()) / 1e9
        self.count += int(values_ns.size)

    def observe_zeros(self, n: int) -> None:
        """``n`` observations of 0 (tokens delivered together with an earlier one)."""
        self.counts[0] += n
        self.count += n

    def to_map(self) -> dict[str, Any]:
        """``{buckets: [upper bounds], counts: [per bucket, not cumulative, + the +Inf one], sum, count}``."""
        return {"buckets": list(self.bounds), "counts": list(self.counts), "sum": self.sum, "count": self.count}


class FrontendMetrics:
    """The frontend's request-level counters and histograms (docs/architecture.md, "Request metrics").

    ``itl`` lags behind the outputs handed to :meth:`observe_outputs` by those held back;
    :meth:`flush` (which :meth:`snapshot` calls) brings it up to date."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self.clients_not_reading = 0  # connections dropped because their send queue was full
        self.ttft = Histogram(TIME_TO_FIRST_TOKEN_BUCKETS_S)
        self.tpot = Histogram(TOKEN_GAP_BUCKETS_S)
        self.itl = Histogram(TOKEN_GAP_BUCKETS_S)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS_S)
        self.queue = Histogram(QUEUE_TIME_BUCKETS_S)
        self.prefill = Histogram(PHASE_TIME_BUCKETS_S)
        self.decode = Histogram(PHASE_TIME_BUCKETS_S)
        self.inference = Histogram(PHASE_TIME_BUCKETS_S)
        self.request_prompt = Histogram(TOKEN_COUNT_BUCKETS)
        self.request_generation = Histogram(TOKEN_COUNT_BUCKETS)
        self.request_max_tokens = Histogram(TOKEN_COUNT_BUCKETS)
        self._held: list[tuple[list[int], int]] = []  # (previous output times, when delivered) per call
        self._num_held = 0

    def add_prompt(self, num_tokens: int) -> None:
        """A request's context went to the scheduler."""
        self.prompt_tokens += num_tokens

    def observe_outputs(self, previous_ns: list[int], now_ns: int) -> None:
        """One handler call's outputs with tokens: for each, the time (``profiling.now_ns``) of
        its stream's previous output, 0 for a stream's first; all delivered at ``now_ns``.
        Each stands for one token (its first; :meth:`observe_together` counts the rest).
        A first output ends no gap (that is the TTFT). The list is kept, not copied: the
        caller hands over a fresh one each time and never changes it afterwards."""
        self.generation_tokens += len(previous_ns)
        self._held.append((previous_ns, now_ns))
        self._num_held += len(previous_ns)
        if self._num_held >= BUCKET_EVERY:
            self.flush()

    def flush(self) -> None:
        """Bucket the inter-token gaps held back, in one numpy pass."""
        held, num = self._held, self._num_held
        if not held:
            return
        self._held, self._num_held = [], 0
        previous = np.fromiter(itertools.chain.from_iterable(p for p, _ in held), dtype=np.int64, count=num)
        delivered = np.repeat(np.array([now for _, now in held], dtype=np.int64), [len(p) for p, _ in held])
        gaps = previous > 0
        self.itl.observe_ns(delivered[gaps] - previous[gaps])

    def observe_together(self, num_tokens: int) -> None:
        """``num_tokens`` more tokens delivered in one output after its first: gaps of 0."""
        self.generation_tokens += num_tokens
        self.itl.observe_zeros(num_tokens)

    def request_finished(
        self,
        reason: str,
        timing: dict[str, float | None] | None,
        num_tokens: int,
        prompt_tokens: int = 0,
        max_tokens: int = 0,
    ) -> None:
        """A request ended with ``reason`` after ``num_tokens`` output tokens, with a context of
        ``prompt_tokens`` (0: never tokenized) and ``max_tokens`` (0: never admitted; neither is
        then observed); ``timing`` is its final's (seconds: ``queue_time``, ``ttft``,
        ``total``), None when no final was sent (its client is gone)."""
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if prompt_tokens:
            self.request_prompt.observe(prompt_tokens)
            self.request_generation.observe(num_tokens)
        if max_tokens:
            self.request_max_tokens.observe(max_tokens)
        if timing is None:
            return
        queue, ttft, total = timing["queue_time"], timing["ttft"], timing["total"]
        if queue is not None:
            self.queue.observe(queue)
            if ttft is not None:
                self.prefill.observe(max(0.0, ttft - queue))
            if total is not None:
                self.inference.observe(max(0.0, total - queue))
        if ttft is not None and total is not None:
            self.decode.observe(max(0.0, total - ttft))
        if ttft is not None:
            self.ttft.observe(ttft)
            if num_tokens > 1 and total is not None:
                self.tpot.observe(max(0.0, total - ttft) / (num_tokens - 1))
        if total is not None:
            self.e2e.observe(total)

    def snapshot(self) -> dict[str, Any]:
        """``{counters: {...}, histograms: {name: Histogram.to_map()}}``, fresh copies (the
        ``metrics`` reply's fields)."""
        self.flush()
        return {
            "counters": {
                PROMPT_TOKENS: self.prompt_tokens,
                GENERATION_TOKENS: self.generation_tokens,
                REQUEST_SUCCESS: dict(self.finished),
                CLIENTS_NOT_READING: self.clients_not_reading,
            },
            "histograms": {
                TIME_TO_FIRST_TOKEN: self.ttft.to_map(),
                TIME_PER_OUTPUT_TOKEN: self.tpot.to_map(),
                INTER_TOKEN_LATENCY: self.itl.to_map(),
                E2E_REQUEST_LATENCY: self.e2e.to_map(),
                REQUEST_QUEUE_TIME: self.queue.to_map(),
                REQUEST_PREFILL_TIME: self.prefill.to_map(),
                REQUEST_DECODE_TIME: self.decode.to_map(),
                REQUEST_INFERENCE_TIME: self.inference.to_map(),
                REQUEST_PROMPT_TOKENS: self.request_prompt.to_map(),
                REQUEST_GENERATION_TOKENS: self.request_generation.to_map(),
                REQUEST_MAX_TOKENS: self.request_max_tokens.to_map(),
            },
        }
