"""Hand-written step plans for tests, a request at a time.

The wire form of a plan names its cached (already running) requests as parallel columns
(:class:`conveyor.ipc.messages.CachedRequests`); tests read and write them more clearly one
row per request. These conversions exist for tests only, so they live here, not beside the
messages.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from conveyor.ipc.messages import CachedRequests, NewRequestData, RequestOutput, StepPlan, TokenOutputs, int_list


class CachedRow(NamedTuple):
    """One request the worker already holds (on ``slot``): run ``num_scheduled_tokens`` more of
    its tokens, appending ``new_block_ids`` to its block table first."""

    slot: int
    new_block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int


def columns(rows: Iterable[CachedRow]) -> CachedRequests:
    """The columnar form plans carry."""
    out = CachedRequests()
    for i, row in enumerate(rows):
        out.slots.append(row.slot)
        out.num_computed_tokens.append(row.num_computed_tokens)
        out.num_scheduled_tokens.append(row.num_scheduled_tokens)
        if row.new_block_ids:
            out.new_block_rows.append(i)
            out.new_block_ids.append(list(row.new_block_ids))
    return out


def rows(cached: CachedRequests) -> list[CachedRow]:
    """One :class:`CachedRow` per column row, in order."""
    blocks = dict(zip(cached.new_block_rows, cached.new_block_ids))
    return [
        CachedRow(slot, list(blocks.get(i, [])), computed, scheduled)
        for i, (slot, computed, scheduled) in enumerate(
            zip(int_list(cached.slots), int_list(cached.num_computed_tokens), int_list(cached.num_scheduled_tokens))
        )
    ]


def plan(
    step: int,
    new: Iterable[NewRequestData] = (),
    cached: Iterable[CachedRow] = (),
    finished: Iterable[int] = (),
    **kwargs,
) -> StepPlan:
    """A :class:`StepPlan` from rows; ``kwargs`` are its remaining fields (swaps, planned_ahead)."""
    return StepPlan(step, list(new), columns(cached), list(finished), **kwargs)


def expanded(outputs: TokenOutputs) -> list[RequestOutput]:
    """Every output of an iteration as a :class:`RequestOutput` (column rows without timing)."""
    return outputs.outputs + [RequestOutput(rid, [t]) for rid, t in zip(outputs.request_ids, outputs.token_ids)]
