"""The scheduler's histogram of tokens per iteration (``vllm:iteration_tokens_total``)."""

from __future__ import annotations

from conveyor.ipc.messages import ITERATION_TOKEN_BUCKETS
from conveyor.scheduler.iteration_log import ITERATION_FIELDS, IterationLog


def row(input_tokens: int) -> tuple:
    values = dict.fromkeys(ITERATION_FIELDS, 0)
    values["input_tokens"] = input_tokens
    return tuple(values[name] for name in ITERATION_FIELDS)


def test_every_iteration_is_bucketed_beyond_the_ring() -> None:
    log = IterationLog(2)
    for tokens in (1, 8, 9, 300, 10**6):
        log.record(row(tokens))
    assert len(log) == 2  # the ring keeps two rows; the histogram counts all five
    expected = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
    for i in (0, 1, 2, ITERATION_TOKEN_BUCKETS.index(512), len(ITERATION_TOKEN_BUCKETS)):
        expected[i] += 1
    assert log.token_counts == expected and log.token_sum == 1 + 8 + 9 + 300 + 10**6
