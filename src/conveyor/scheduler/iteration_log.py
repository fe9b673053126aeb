"""Per-iteration metadata of the scheduler: a small ring of recent iterations plus counters.

One tuple per iteration into a bounded deque: cheap enough to record always (a fraction of a
microsecond against the iteration's tens of microseconds), and bounded, so memory never grows
with uptime. Readers (the stats reply, the profiler) get rows in :data:`ITERATION_FIELDS`
order, oldest first.
"""

from __future__ import annotations

import bisect
from collections import deque

from conveyor.ipc.messages import ITERATION_TOKEN_BUCKETS

ITERATION_FIELDS: tuple[str, ...] = (
    "step",  # plan step id
    "time",  # scheduler clock (time.time() in the server) when the plan was formed
    "batch_size",  # requests in the plan
    "num_new",  # of those, sent as NewRequestData (admitted or resumed)
    "prefill_tokens",  # tokens of requests with more than one token to run
    "decode_tokens",  # requests running exactly one token
    "input_tokens",  # prefill_tokens + decode_tokens: the forward's batch size in tokens
    "context_tokens",  # sum over the plan of (computed + scheduled): the attention's reach
    "admitted",  # requests admitted for the first time
    "avg_wait",  # seconds from arrival to this admission, averaged over those (0 if none)
    "max_wait",
    "free_blocks",  # GPU block states after planning
    "held_blocks",
    "cached_blocks",
    "swapped_blocks",  # CPU blocks held by swapped-out requests
    "preempted_swap",  # preemptions in this iteration, by kind
    "preempted_recompute",
    "swap_out_blocks",  # copies the plan carries
    "swap_in_blocks",
    "prefix_hit_tokens",  # tokens admissions took from the prefix cache
    "schedule_us",  # microseconds schedule() took
    "planned_ahead",  # 1 if formed while the previous plan was in flight (overlap), else 0
)


_INPUT_TOKENS = ITERATION_FIELDS.index("input_tokens")


class IterationLog:
    """The last ``size`` iterations, one tuple each (fields as :data:`ITERATION_FIELDS`), and
    since start a histogram of every iteration's input tokens (``token_counts``: per bucket
    of :data:`ITERATION_TOKEN_BUCKETS`, the last above every bound; ``token_sum``)."""

    def __init__(self, size: int) -> None:
        self._rows: deque[tuple] = deque(maxlen=size)
        self.token_counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.token_sum = 0

    def record(self, row: tuple) -> None:
        self._rows.append(row)
        tokens = row[_INPUT_TOKENS]
        self.token_counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
        self.token_sum += tokens

    def rows(self) -> list[list[int | float]]:
        return [list(r) for r in self._rows]

    def last(self) -> dict[str, int | float] | None:
        """The most recent iteration as a map, or None (for tests and debugging)."""
        return dict(zip(ITERATION_FIELDS, self._rows[-1])) if self._rows else None

    def __len__(self) -> int:
        return len(self._rows)
