"""Logits -> token ids for a whole batch in a fixed number of torch ops, no per-row Python.

Controls, then grammar masks, then greedy argmax or temperature, top-k, top-p, min-p and the
exponential race with counter-based noise, so a seeded row's draw depends only on its own
logits; which filters run is decided on the host (docs/architecture.md, "Sampling").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from conveyor.ipc.messages import SamplingParams
from conveyor.kernels.layer_ops import softmax_rows
from conveyor.worker.grammar_mask import apply_token_bitmask
from conveyor.worker.sampling_controls import ControlRows, SamplingControls

_GAMMA = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
# Uniforms are bucket midpoints (2k + 1) / 2**(_NOISE_BITS + 1): with 23 bits every one is exact in
# float32 and below 1. (24 bits made the top bucket's midpoint 1 - 2**-25, which rounds to 1.0:
# its exponential noise was 0, and a token of weight 0 then raced as 0 / 0 = NaN, which argmax
# picks: a masked or filtered token drawn about once in 2**24 tokens' noise.)
_NOISE_BITS = 23


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch holds it."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of int64 ``x`` (add the golden gamma, then the finalizer), elementwise:
    nearby inputs give unrelated 64-bit outputs. int64 multiply and add wrap modulo 2**64, so
    the bit patterns equal the unsigned algorithm's."""
    x = x + _signed(_GAMMA)
    x = (x ^ _shift_right(x, 30)) * _signed(_MUL1)
    x = (x ^ _shift_right(x, 27)) * _signed(_MUL2)
    return x ^ _shift_right(x, 31)


def draw_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 key of each seeded draw: a hash of (seed, position of the token being drawn)."""
    return splitmix64(splitmix64(seeds) ^ positions)


def stream_uniforms(keys: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """float32 ``[N, count]`` uniforms in ``(0, 1)``: entry ``(i, j)`` is element ``first + j``
    of the splitmix64 stream started at ``keys[i]``, its top ``_NOISE_BITS`` bits (bucket midpoints,
    exact in float32, never 0 or 1). Element 0 is the speculative verification's acceptance uniform,
    elements 1.. the exponential noise of :func:`exponential_noise`: one key, independent draws."""
    steps = torch.arange(first, first + count, dtype=torch.int64, device=keys.device) * _signed(_GAMMA)
    bits = _shift_right(splitmix64(keys[:, None] + steps[None, :]), 64 - _NOISE_BITS)
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << _NOISE_BITS))


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 ``[N, vocab]`` Exp(1) draws; entry ``(i, j)`` depends only on ``keys[i]`` and ``j``.

    Token ``j`` of row ``i`` takes element ``j + 1`` of the row's stream
    (:func:`stream_uniforms`): ``-log(u)`` is exponential, never 0."""
    return stream_uniforms(keys, 1, vocab).log_().neg_()


def race(weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``[N]`` draws from the rows of non-negative ``weights`` ``[N, V]`` (normalized or not):
    ``argmax(w / E)`` with ``E`` the rows' :func:`exponential_noise` picks ``j`` with
    probability ``w_j / sum(w)``."""
    return (weights / exponential_noise(keys, weights.shape[-1])).argmax(dim=-1)


@dataclass
class SamplingBatch:
    """One step's sampling parameters, a device tensor per field (``[N]`` rows), and what the
    host knows of them (which filters any row uses), so that unused filters cost nothing.

    ``temperature`` 0 means greedy; ``top_k`` <= 0 or >= vocab, ``top_p`` >= 1 and ``min_p``
    <= 0 disable their filter; ``seed`` is read only where ``seeded``; ``positions`` is the
    sequence position of the token each row draws (keys seeded draws and bounds
    ``min_tokens``); ``controls``: the rows that use sampling controls, None when none does."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32
    seed: torch.Tensor  # int64
    seeded: torch.Tensor  # bool
    positions: torch.Tensor  # int64
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_unseeded: bool  # a sampling (non-greedy) row without a seed
    controls: ControlRows | None = None
    # Structured output: an int32 grammar bitmask with one row per logits row, applied to
    # ``bitmask_rows`` only (conveyor.worker.grammar_rows fills it); None: no constrained row.
    bitmask: torch.Tensor | None = None
    bitmask_rows: Sequence[int] = ()


class SamplingColumns:
    """Per-slot host columns of sampling parameters (numpy), set once when a request takes a
    slot: a step's rows are then one gather per column, not a loop over requests."""

    FIELDS: tuple[tuple[str, np.dtype], ...] = (
        ("temperature", np.dtype(np.float32)),
        ("top_k", np.dtype(np.int64)),
        ("top_p", np.dtype(np.float32)),
        ("min_p", np.dtype(np.float32)),
        ("seed", np.dtype(np.int64)),
        ("seeded", np.dtype(np.bool_)),
    )

    def __init__(self) -> None:
        self.columns = {name: np.zeros(0, dtype) for name, dtype in self.FIELDS}
        # Beside the sampler's fields (not part of a SamplingBatch): the number of top
        # log-probabilities each slot's request asks for with its sampled tokens, -1 for none,
        # so the host tells from one gather whether a step computes any.
        self.logprobs = np.zeros(0, np.int64)
        # The slots whose request asked for prompt log-probabilities (the runner forgets one
        # once its prompt is computed): while empty, no step looks for prompt positions to score.
        self.prompt_logprobs_slots: set[int] = set()

    def set(self, slot: int, params: SamplingParams) -> None:
        size = len(self.columns["seed"])
        if slot >= size:
            new_size = max(slot + 1, 2 * size, 16)
            self.columns = {name: _grown(column, new_size, 0) for name, column in self.columns.items()}
            self.logprobs = _grown(self.logprobs, new_size, -1)
        values = row_values(params)
        for name, column in self.columns.items():
            column[slot] = values[name]
        self.logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        if params.prompt_logprobs is None:
            self.prompt_logprobs_slots.discard(slot)
        else:
            self.prompt_logprobs_slots.add(slot)

    def gather(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        return {name: column[slots] for name, column in self.columns.items()}


def _grown(column: np.ndarray, size: int, fill: int) -> np.ndarray:
    """``column`` extended to ``size`` entries, the new ones ``fill``."""
    grown = np.full(size, fill, column.dtype)
    grown[: len(column)] = column
    return grown


def row_values(params: SamplingParams) -> dict[str, float | int | bool]:
    """One request's row of :class:`SamplingColumns`."""
    return {
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "seed": _signed(params.seed) if params.seed is not None else 0,
        "seeded": params.seed is not None,
    }


def host_flags(rows: dict[str, np.ndarray], vocab: int) -> dict[str, bool]:
    """The host half of a :class:`SamplingBatch`: which filters the (real) rows use."""
    sampling = rows["temperature"] > 0
    return {
        "all_greedy": not sampling.any(),
        "any_top_k": bool((sampling & (rows["top_k"] > 0) & (rows["top_k"] < vocab)).any()),
        "any_top_p": bool((sampling & (rows["top_p"] < 1.0)).any()),
        "any_min_p": bool((sampling & (rows["min_p"] > 0.0)).any()),
        "any_unseeded": bool((sampling & ~rows["seeded"]).any()),
    }


class Sampler:
    """Turns float32 logits ``[N, V]`` into ``[N]`` int64 token ids on the logits' device.
    ``invariant``: batch-invariant mode (its softmaxes through :func:`softmax_rows`'s kernel on CUDA)."""

    def __init__(self, device: torch.device | str, seed: int | None = None, invariant: bool = False) -> None:
        self.device = torch.device(device)
        self.invariant = invariant
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        positions: Sequence[int],
        histories: Sequence[tuple[Sequence[int], int]] | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> torch.Tensor:
        """Sample rows given as :class:`SamplingParams` (tests, small callers): builds the
        :class:`SamplingBatch` and calls :meth:`sample`. ``positions[i]`` keys row ``i``'s
        seeded draw: any per-request index that names this draw the same way every time it
        is made (the runner passes the sequence position of the token being sampled).
        ``histories[i]``: row ``i``'s tokens so far and how many of them are its prompt,
        which its sampling controls read (default: none), with ``eos_token_ids``."""
        if len(params) != logits.shape[0] or len(positions) != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logits rows, {len(params)} params, {len(positions)} positions")
        columns = SamplingColumns()
        controls = SamplingControls(logits.shape[1], logits.device, eos_token_ids)
        for row, p in enumerate(params):
            columns.set(row, p)
            tokens, num_prompt = histories[row] if histories is not None else ((), 0)
            controls.assign(row, p, tokens, num_prompt)
        rows = columns.gather(np.arange(len(params)))
        positions = np.asarray(positions, np.int64)
        selected = controls.upload(controls.select(np.arange(len(params)), positions))
        return self.sample(logits, batch_from_rows(rows, positions, logits.shape[1], logits.device, selected))

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Token ids ``[N]`` for float32 ``logits`` ``[N, V]``; nothing here waits for the device.
        With a grammar bitmask, the constrained rows of the (controlled) logits are masked in place."""
        controls = batch.controls
        if controls is not None:
            logits = controls.apply(logits, batch.positions)
        if batch.bitmask is not None:
            apply_token_bitmask(logits, batch.bitmask, batch.bitmask_rows)
        sampled = self._draw(logits, batch)
        if controls is not None:
            controls.record(sampled)
        return sampled

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Each row's draw from its :meth:`distribution` (module docstring); a batch of greedy
        rows takes the argmax at once (what the race on their point masses would give)."""
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        return race(self.distribution(logits, batch), self.keys(batch))

    def distribution(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """float32 ``[N, V]``: the distribution each row draws from. A greedy row's is a point
        mass at its argmax; a sampling row's the softmax of its logits over its temperature
        after top-k, top-p and min-p. The one definition of what a row samples from: the
        speculative verification (:mod:`conveyor.worker.speculative_verify`) reads it too."""
        greedy = logits.argmax(dim=-1)
        vocab = logits.shape[-1]
        device = logits.device
        sampling = batch.temperature > 0
        logits = logits / torch.where(sampling, batch.temperature, 1.0)[:, None]
        if batch.any_top_k or batch.any_top_p:
            # Both filters act on ranks: mask in descending order, then put tokens back in
            # vocabulary order so a row's draw never depends on whether its batch sorted.
            ranked, order = logits.sort(dim=-1, descending=True)
            if batch.any_top_k:
                top_k = torch.where((batch.top_k > 0) & (batch.top_k < vocab), batch.top_k, vocab)
                ranks = torch.arange(vocab, device=device)
                ranked = ranked.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
            if batch.any_top_p:
                top_p = torch.where(batch.top_p < 1.0, batch.top_p, float("inf"))
                probs = softmax_rows(ranked, invariant=self.invariant)
                # A token stays while the mass ranked before it is below top_p: the first always stays.
                mass_before = probs.cumsum(dim=-1) - probs
                ranked = ranked.masked_fill(mass_before >= top_p[:, None], float("-inf"))
            logits = torch.empty_like(ranked).scatter_(-1, order, ranked)
        if batch.any_min_p:
            probs = softmax_rows(logits, invariant=self.invariant)
            threshold = batch.min_p.clamp_min(0.0)[:, None] * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        probs = torch.where(sampling[:, None], softmax_rows(logits, invariant=self.invariant), 0.0)
        # greedy rows: 1 at the argmax (sampling rows add 0)
        return probs.scatter_add_(1, greedy[:, None], (~sampling).to(probs.dtype)[:, None])

    def keys(self, batch: SamplingBatch) -> torch.Tensor:
        """int64 ``[N]`` noise keys of the rows' draws: a seeded row's :func:`draw_keys`, the
        other sampling rows' from the sampler's generator (module docstring)."""
        keys = draw_keys(batch.seed, batch.positions)
        if batch.any_unseeded:
            drawn = torch.randint(
                -(1 << 63), (1 << 63) - 1, keys.shape, generator=self._generator, dtype=torch.int64, device=keys.device
            )
            keys = torch.where(batch.seeded, keys, drawn)
        return keys


def batch_from_rows(
    rows: dict[str, np.ndarray],
    positions: np.ndarray,
    vocab: int,
    device: torch.device | str,
    controls: ControlRows | None = None,
) -> SamplingBatch:
    """A :class:`SamplingBatch` from host rows (one copy per column: the dynamic step's way;
    the static decode step views its columns in its staging buffer instead)."""

    def dev(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)

    columns = {name: dev(rows[name]) for name, _ in SamplingColumns.FIELDS}
    return batch_of_columns(columns, dev(positions), host_flags(rows, vocab), controls)


def batch_of_columns(
    columns: Mapping[str, torch.Tensor],
    positions: torch.Tensor,
    flags: dict[str, bool],
    controls: ControlRows | None = None,
) -> SamplingBatch:
    """A :class:`SamplingBatch` of the device columns named in :attr:`SamplingColumns.FIELDS`
    (other entries of ``columns`` are ignored), the draws' ``positions``, the
    :func:`host_flags` and the step's controlled rows: the one mapping from columns to
    fields, for the dynamic step's fresh copies and the static decode step's views of its
    staging buffer alike."""
    return SamplingBatch(
        **{name: columns[name] for name, _ in SamplingColumns.FIELDS}, positions=positions, **flags, controls=controls
    )


def logprobs_of(
    logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, width: int, invariant: bool = False
) -> tuple[torch.Tensor, ...]:
    """Log-probabilities of ``logits`` rows ``rows``: each row's ``tokens`` entry ``[R]`` and
    its ``width`` most likely tokens ``([R, width]`` ids and values, most likely first).

    The log-softmax of the *raw* logits in float32, before temperature and the filters (what
    vLLM returns by default): what the model gives the token, not what the sampler's
    reshaped distribution gave it. Only the ``rows`` asked for are normalized; the caller
    decides on the host whether to call at all, so a step that asks for none runs nothing.
    ``invariant``: batch-invariant mode (:func:`softmax_rows`)."""
    lp = softmax_rows(logits.index_select(0, rows), log=True, invariant=invariant)
    chosen = lp.gather(1, tokens.view(-1, 1)).view(-1)
    if width:
        top_lp, top_ids = lp.topk(width, dim=-1)
    else:
        top_lp = lp.new_empty((lp.shape[0], 0))
        top_ids = torch.empty((lp.shape[0], 0), dtype=torch.int64, device=lp.device)
    return chosen, top_ids, top_lp
