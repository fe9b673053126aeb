"""Sampling controls on the device: penalties, ``logit_bias`` and ``min_tokens``, batched.

The definitions and ranges are vLLM's (docs/architecture.md, "Sampling controls: the
definitions"). A request that uses any control takes a pool row of dense per-vocabulary
tensors when it takes its slot, its output counts updated on the device by the step that
samples; a step with no controlled row runs none of it ("Sampling controls").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from conveyor.ipc.messages import SamplingParams


@dataclass(frozen=True)
class ControlSelection:
    """The host half of a step's controls: which logits rows are controlled (``rows``,
    increasing), their pool rows, and which passes any of them needs."""

    rows: np.ndarray  # int64: indices into the step's logits rows
    pool_rows: np.ndarray  # int64
    any_bias: bool
    any_min_tokens: bool
    any_repetition: bool  # a repetition penalty
    any_additive: bool  # a presence or frequency penalty


@dataclass
class ControlRows:
    """A step's controlled rows on the device (a :class:`ControlSelection` uploaded), applied
    to its logits by the sampler and updated with what it sampled."""

    state: SamplingControls
    rows: torch.Tensor  # int64 [C]
    pool_rows: torch.Tensor  # int64 [C]
    any_bias: bool
    any_min_tokens: bool
    any_repetition: bool
    any_additive: bool

    def apply(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[N, V]`` (float32) with the controls applied to the controlled rows,
        out of place; ``positions[i]``: the sequence position of the token row ``i`` draws.
        The controlled rows are gathered once and updated in place (fresh memory)."""
        state, pool = self.state, self.pool_rows
        sub = logits.index_select(0, self.rows)
        if self.any_bias:
            sub.add_(state.dense["bias"].index_select(0, pool))
        if self.any_min_tokens:
            active = positions.index_select(0, self.rows) < state.min_until.index_select(0, pool)
            sub.masked_fill_(state.dense["stop_ids"].index_select(0, pool) & active[:, None], float("-inf"))
        if self.any_repetition or self.any_additive:
            counts = state.dense["counts"].index_select(0, pool)
            in_output = counts > 0
            if self.any_repetition:
                seen = in_output | state.dense["prompt"].index_select(0, pool)
                repetition = state.repetition.index_select(0, pool)
                factor = torch.where(seen, repetition[:, None], 1.0)
                # x / r where x > 0, else x * r, is the smaller of the two when r >= 1 and the
                # larger when r < 1 (rounding is monotonic, so also in float; -inf stays -inf):
                # a minimum of sign-flipped values, flipped back. A torch.where over [C, V]
                # floats measured ~10x slower than these passes each on a CPU.
                sign = torch.where(repetition >= 1, 1.0, -1.0)[:, None]
                sub = torch.minimum((sub / factor).mul_(sign), (sub * factor).mul_(sign)).mul_(sign)
            if self.any_additive:
                sub.sub_(counts * state.frequency.index_select(0, pool)[:, None])
                sub.sub_(in_output * state.presence.index_select(0, pool)[:, None])
        return logits.index_copy(0, self.rows, sub)

    def record(self, sampled: torch.Tensor) -> None:
        """Count the ids the step sampled (``sampled[i]`` for logits row ``i``) in the
        controlled rows' output counts. Only needed (and done) when a row is penalized."""
        if self.any_repetition or self.any_additive:
            state = self.state
            tokens = sampled.index_select(0, self.rows)
            state.dense["counts"].index_put_((self.pool_rows, tokens), state.one, accumulate=True)


class SamplingControls:
    """The pool rows of the requests that use sampling controls, by slot (module docstring)."""

    # The dense [rows, vocab] tensors and their dtypes, each made when first needed.
    DENSE = {"counts": torch.int32, "prompt": torch.bool, "bias": torch.float32, "stop_ids": torch.bool}

    def __init__(self, vocab_size: int, device: torch.device | str, eos_token_ids: Iterable[int]) -> None:
        self.vocab = vocab_size
        self.device = torch.device(device)
        self.eos_ids = sorted(set(eos_token_ids))
        self.row_of_slot = np.zeros(0, np.int64)  # -1: the slot's request has no pool row
        self.size = 0  # pool rows allocated
        self._free: list[int] = []
        self.held = 0  # pool rows in use
        # Per pool row, on the host: which passes it needs, and its min_tokens bound.
        self.has_bias = np.zeros(0, np.bool_)
        self.has_repetition = np.zeros(0, np.bool_)
        self.has_additive = np.zeros(0, np.bool_)
        self.min_until_host = np.zeros(0, np.int64)
        # Per pool row, on the device.
        self.presence = torch.zeros(0, dtype=torch.float32, device=self.device)
        self.frequency = torch.zeros(0, dtype=torch.float32, device=self.device)
        self.repetition = torch.ones(0, dtype=torch.float32, device=self.device)
        self.min_until = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.dense: dict[str, torch.Tensor] = {}
        self.one = torch.ones(1, dtype=torch.int32, device=self.device)

    def assign(self, slot: int, params: SamplingParams, token_ids: Sequence[int], num_prompt: int) -> None:
        """The request on ``slot`` (``token_ids``: all its tokens, the first ``num_prompt``
        its prompt) takes a pool row if it uses a control, its state built from its tokens.
        Any row the slot held is given back first."""
        self.release([slot])
        if not params.controlled:
            return
        if slot >= len(self.row_of_slot):
            grown = np.full(max(slot + 1, 2 * len(self.row_of_slot), 16), -1, np.int64)
            grown[: len(self.row_of_slot)] = self.row_of_slot
            self.row_of_slot = grown
        row = self._take_row()
        self.row_of_slot[slot] = row
        dev = self.device
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.repetition[row] = params.repetition_penalty
        self.has_repetition[row] = params.repetition_penalty != 1.0
        self.has_additive[row] = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        if params.penalized:
            ids = torch.tensor(list(token_ids), dtype=torch.int64).to(dev, non_blocking=True)
            prompt = self._dense("prompt")[row]
            prompt.zero_()
            prompt.index_fill_(0, ids[:num_prompt], True)
            counts = self._dense("counts")[row]
            counts.zero_()
            counts.index_add_(0, ids[num_prompt:], self.one.expand(len(token_ids) - num_prompt))
        self.has_bias[row] = bool(params.logit_bias)
        if params.logit_bias or "bias" in self.dense:
            bias = self._dense("bias")[row]
            bias.zero_()  # (a row without bias must add nothing: clear what its last holder left)
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), dtype=torch.int64)
                values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
                bias.index_put_((ids.to(dev, non_blocking=True),), values.to(dev, non_blocking=True))
        stop_ids = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids)))
        until = num_prompt + params.min_tokens if params.min_tokens > 0 and stop_ids else 0
        self.min_until_host[row] = until
        self.min_until[row] = until
        if until:
            mask = self._dense("stop_ids")[row]
            mask.zero_()
            mask[torch.tensor(stop_ids, dtype=torch.int64).to(dev, non_blocking=True)] = True

    def release(self, slots: Iterable[int]) -> None:
        """The requests on ``slots`` are gone: their pool rows are free again."""
        table = self.row_of_slot
        for slot in slots:
            if slot < len(table) and table[slot] >= 0:
                self._free.append(int(table[slot]))
                table[slot] = -1
                self.held -= 1

    def select(self, slots: np.ndarray, positions: np.ndarray) -> ControlSelection | None:
        """Which of a step's sampling rows (``slots[i]`` drawing at ``positions[i]``) are
        controlled and which passes they need; None when no pass runs (no cost)."""
        if not self.held:
            return None
        table = self.row_of_slot
        pool = np.where(slots < len(table), table[np.minimum(slots, len(table) - 1)], -1)
        rows = np.flatnonzero(pool >= 0)
        if not len(rows):
            return None
        pool = pool[rows]
        any_bias = bool(self.has_bias[pool].any())
        any_min = bool((positions[rows] < self.min_until_host[pool]).any())
        any_repetition = bool(self.has_repetition[pool].any())
        any_additive = bool(self.has_additive[pool].any())
        if not (any_bias or any_min or any_repetition or any_additive):
            return None
        return ControlSelection(rows, pool, any_bias, any_min, any_repetition, any_additive)

    def upload(self, selection: ControlSelection | None) -> ControlRows | None:
        """A selection's rows as fresh device tensors (the ragged step's way; the decode
        step views them in its staging buffer and calls :meth:`rows_of` instead)."""
        if selection is None:
            return None

        def dev(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)

        return self.rows_of(selection, dev(selection.rows), dev(selection.pool_rows))

    def rows_of(self, selection: ControlSelection, rows: torch.Tensor, pool_rows: torch.Tensor) -> ControlRows:
        """The :class:`ControlRows` of ``selection`` over its device ``rows`` and ``pool_rows``."""
        flags = (selection.any_bias, selection.any_min_tokens, selection.any_repetition, selection.any_additive)
        return ControlRows(self, rows, pool_rows, *flags)

    def _take_row(self) -> int:
        if not self._free:
            self._grow(max(2 * self.size, 8))
        self.held += 1
        return self._free.pop()

    def _grow(self, size: int) -> None:
        """Room for ``size`` pool rows: every per-row array and made dense tensor grows."""
        old = self.size

        def host(array: np.ndarray, fill) -> np.ndarray:
            grown = np.full(size, fill, array.dtype)
            grown[:old] = array
            return grown

        def device(tensor: torch.Tensor, fill) -> torch.Tensor:
            grown = torch.full((size, *tensor.shape[1:]), fill, dtype=tensor.dtype, device=self.device)
            grown[:old] = tensor
            return grown

        self.has_bias = host(self.has_bias, False)
        self.has_repetition = host(self.has_repetition, False)
        self.has_additive = host(self.has_additive, False)
        self.min_until_host = host(self.min_until_host, 0)
        self.presence = device(self.presence, 0.0)
        self.frequency = device(self.frequency, 0.0)
        self.repetition = device(self.repetition, 1.0)
        self.min_until = device(self.min_until, 0)
        self.dense = {name: device(tensor, 0) for name, tensor in self.dense.items()}
        self._free.extend(range(size - 1, old - 1, -1))  # (popped from the end: lowest first)
        self.size = size

    def _dense(self, name: str) -> torch.Tensor:
        """The ``[rows, vocab]`` tensor ``name``, made (zeroed) on first use."""
        tensor = self.dense.get(name)
        if tensor is None:
            tensor = self.dense[name] = torch.zeros(self.size, self.vocab, dtype=self.DENSE[name], device=self.device)
        return tensor
