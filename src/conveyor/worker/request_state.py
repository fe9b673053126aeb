"""What the worker remembers between steps about each request it holds, by slot.

Plans name requests by *slot* (:mod:`conveyor.ipc.messages`), so the state lives in a list
indexed by slot, as long as the largest slot seen (at most the scheduler's ``max_num_seqs``),
never shrinking. Beside it, every held slot's block table is a row of one matrix, so a step's
tables are one gather of its rows, not a copy per request. The scheduler stays the authority
on blocks, slots and counts; :mod:`~conveyor.worker.plan_check` checks each plan against
this state before anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from conveyor.ipc.messages import NewRequestData, SamplingParams, int_list

if TYPE_CHECKING:
    from conveyor.worker.grammar_rows import GrammarRow


@dataclass
class RequestState:
    """Invariant: ``num_computed <= len(token_ids)``, and the KV of tokens
    ``0..num_computed-1`` is in the cache blocks ``block_ids`` name. ``request_id`` is only
    for messages: plans name the request by its slot."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    sampling: SamplingParams
    num_computed: int
    pending: int = 0  # tokens sampled by a launched step, not yet appended (0 or 1)
    adapter: int = 0  # LoRA adapter id (conveyor.worker.lora.LoraManager; 0: the base model)
    grammar: GrammarRow | None = None  # structured output: its matcher (rank 0 only)
    num_prompt: int = 0  # token_ids[:num_prompt] is the prompt (its log-probabilities' range)

    @property
    def num_known(self) -> int:
        return len(self.token_ids) + self.pending


@dataclass(frozen=True)
class Work:
    """One request's share of a checked step: run tokens ``num_computed .. num_computed +
    num_scheduled - 1`` after appending ``new_block_ids`` to its table."""

    slot: int
    num_computed: int
    num_scheduled: int
    new_block_ids: list[int]
    # Speculative decoding: the proposed tokens this row verifies after its last known token
    # (``num_scheduled == 1 + num_proposed``): given by the plan (n-gram), or ``num_drafted``
    # tokens the runner's draft model makes in this step; neither for any other row.
    proposal: tuple[int, ...] = ()
    num_drafted: int = 0

    @property
    def num_proposed(self) -> int:
        return len(self.proposal) or self.num_drafted


class SlotStates:
    """The request state of every slot (``states[slot]``, None: free) and the block-table
    matrix (``tables[slot]``: a copy of that state's ``block_ids``, zero past them)."""

    def __init__(self) -> None:
        self.states: list[RequestState | None] = []
        self.tables = np.zeros((0, 0), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.states)

    @property
    def slots(self) -> list[int]:
        """The slots whose request state is held, in increasing order."""
        return [slot for slot, state in enumerate(self.states) if state is not None]

    @property
    def request_ids(self) -> list[str]:
        """The ids of the requests held, in slot order."""
        return [state.request_id for state in self.states if state is not None]

    def drop(self, slots: list[int]) -> None:
        """Forget the requests on ``slots`` (checked to be in range). A free slot is fine:
        its request may never have been taken in (its plan failed unrun)."""
        states = self.states
        for slot in slots:
            if slot < len(states):
                states[slot] = None

    def take_in(self, new: NewRequestData, adapter: int = 0) -> None:
        """Hold a new request on its slot (free: checked, the plan's drops done first), under
        LoRA adapter id ``adapter`` (0: the base model)."""
        states = self.states
        if new.slot >= len(states):
            states.extend([None] * (new.slot + 1 - len(states)))
        tokens, blocks = int_list(new.token_ids), int_list(new.block_ids)
        states[new.slot] = RequestState(
            new.request_id,
            tokens,
            blocks,
            new.sampling,
            new.num_computed_tokens,
            adapter=adapter,
            num_prompt=len(tokens) if new.num_prompt_tokens is None else new.num_prompt_tokens,
        )
        self.set_table(new.slot, 0, blocks, clear=True)

    def extend_blocks(self, slot: int, state: RequestState, blocks: list[int]) -> None:
        """Append ``blocks`` to the table of the request on ``slot``."""
        self.set_table(slot, len(state.block_ids), blocks)
        state.block_ids.extend(blocks)

    def set_table(self, slot: int, start: int, blocks: list[int], clear: bool = False) -> None:
        """Write ``blocks`` into slot's block table row from column ``start`` (growing the
        table as needed); ``clear`` zeroes the rest of the row (a new request on the slot)."""
        tables = self.tables
        rows, cols = tables.shape
        end = start + len(blocks)
        if slot >= rows or end > cols:
            new_rows = rows if slot < rows else max(slot + 1, 2 * rows)
            new_cols = cols if end <= cols else max(end, 2 * cols)
            grown = np.zeros((new_rows, new_cols), dtype=np.int64)
            grown[:rows, :cols] = tables
            self.tables = tables = grown
        if clear:
            tables[slot, end:] = 0
        tables[slot, start:end] = blocks
