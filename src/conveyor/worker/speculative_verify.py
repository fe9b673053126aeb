"""Verification of a step's speculative rows: rejection sampling, on the device, batched.

A proposed token ``x`` is kept with probability ``min(1, p(x) / q(x))`` (``p`` the target's
distribution, ``q`` the proposer's; point masses for the n-gram proposer), the first
rejection emits a draw from ``norm(max(0, p - q))``, so every emitted token is distributed as
the target's; greedy keeps ``x`` iff it is the argmax. docs/architecture.md, "Verifying
proposals", gives the argument, the draw keys and the proposers' interface.
"""

from __future__ import annotations

import numpy as np
import torch

from conveyor.worker.last_tokens import LastTokens
from conveyor.worker.parallel import TensorParallel, broadcast_from_first_
from conveyor.worker.request_state import RequestState, Work
from conveyor.worker.sampler import Sampler, SamplingColumns, batch_from_rows, exponential_noise, stream_uniforms


def residual_weights(probs: torch.Tensor, proposed: torch.Tensor, draft_probs: torch.Tensor | None) -> torch.Tensor:
    """``max(0, p - q)`` per row, unnormalized (the race normalizes): ``p`` with the proposed
    token zeroed for point masses."""
    if draft_probs is None:
        return probs.scatter(1, proposed[:, None], 0.0)
    return (probs - draft_probs).clamp_min_(0.0)


def acceptance(
    probs: torch.Tensor,
    proposed: torch.Tensor,
    draft_probs: torch.Tensor | None,
    keys: torch.Tensor,
    noise: torch.Tensor,
    best_residual: torch.Tensor,
) -> torch.Tensor:
    """bool ``[R]``: each proposed token accepted with probability ``min(1, p(x) / q(x))``.
    Point masses: ``x`` wins the race over ``p`` (``p(x) / E_x`` beats ``best_residual``, the
    largest ``(p / E)`` over the other tokens); else the key's own uniform ``u``:
    ``u q(x) < p(x)``."""
    p_x = probs.gather(1, proposed[:, None])[:, 0]
    if draft_probs is None:
        return p_x / noise.gather(1, proposed[:, None])[:, 0] > best_residual
    q_x = draft_probs.gather(1, proposed[:, None])[:, 0]
    return stream_uniforms(keys, 0, 1)[:, 0] * q_x < p_x


def verify_proposals(
    probs: torch.Tensor, proposed: torch.Tensor, keys: torch.Tensor, draft_probs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of ``R`` proposed tokens at once (docs/architecture.md, "Verifying
    proposals"): ``probs``
    float32 ``[R, V]`` the target's distribution at each, ``proposed`` int64 ``[R]``, ``keys``
    int64 ``[R]`` their draw keys, ``draft_probs`` ``[R, V]`` or None (point masses). Returns
    on the device ``accepted`` bool ``[R]`` and ``residual`` int64 ``[R]``, the token a
    rejection at that position emits (meaningless where the residual is empty, which only
    happens where ``accepted`` is certain)."""
    noise = exponential_noise(keys, probs.shape[-1])
    scores = residual_weights(probs, proposed, draft_probs) / noise
    best, residual = scores.max(dim=-1)
    return acceptance(probs, proposed, draft_probs, keys, noise, best), residual


class SpeculativeVerify:
    """The verification part of a runner: its ``sampler`` and per-slot ``sampling`` columns
    give each proposed position's distribution and draw key; ``last_tokens`` is told each
    speculative row's last emitted token; under ``tensor_parallel`` rank 0's verdict is shared."""

    def __init__(
        self, sampler: Sampler, sampling: SamplingColumns, last_tokens: LastTokens, tensor_parallel: TensorParallel,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.sampler = sampler
        self.sampling = sampling
        self.last_tokens = last_tokens
        self.tensor_parallel = tensor_parallel
        self.device = device

    def verify(
        self,
        logits: torch.Tensor,
        work: list[Work],
        slots: np.ndarray,
        proposed: torch.Tensor | None = None,
        draft_probs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Enqueue the verification of the step's speculative rows: ``logits`` ``[R, V]`` the
        target's at every proposed position, rows in flat proposal order; ``proposed`` the
        proposed tokens on the device in that order (a draft model's), None: the plan's. Returns
        int64 ``[2, R]`` on the device: accepted (0/1) and the residual draw of each position."""
        spec = [i for i, item in enumerate(work) if item.num_proposed]
        lengths = [work[i].num_proposed for i in spec]
        # The token position each logits row draws: after the row's last known token.
        positions = np.concatenate(
            [np.arange(1, n + 1, dtype=np.int64) + work[i].num_computed for i, n in zip(spec, lengths)]
        )
        rows = self.sampling.gather(np.repeat(slots[spec], lengths))
        batch = batch_from_rows(rows, positions, logits.shape[1], logits.device)
        if proposed is None:
            proposed = torch.tensor([t for i in spec for t in work[i].proposal], dtype=torch.int64)
            proposed = proposed.to(logits.device, non_blocking=True)
        if batch.all_greedy:  # the rule on point masses made fast: keep x iff the argmax, else emit it
            target = logits.argmax(dim=-1)
            return torch.stack([(proposed == target).to(torch.int64), target])
        keys = self.sampler.keys(batch)
        accepted, residual = verify_proposals(self.sampler.distribution(logits, batch), proposed, keys, draft_probs)
        return torch.stack([accepted.to(torch.int64), residual])

    def shared_verdict(self, verdict: torch.Tensor | None, count: int) -> torch.Tensor:
        """Rank 0's verdict on the step's ``count`` proposed tokens on every rank of a
        tensor-parallel group (``verdict``: this rank's, None where it holds no LM head), so
        that every rank accepts the same tokens and keeps the same request state; the same
        tensor at size 1."""
        if self.tensor_parallel.size == 1:
            return verdict
        if verdict is None:
            verdict = torch.empty(2, count, dtype=torch.int64, device=self.device)
        return broadcast_from_first_(verdict, self.tensor_parallel)

    def accept(
        self, verdict: list[list[int]], rows: list[int], proposals: list[tuple[int, ...]], slots: list[int],
        states: list[RequestState], tokens: list[int],
    ) -> tuple[list[int], list[list[int]]]:  # fmt: skip
        """The host's part, at the finish: sampling row ``rows[i]`` (of ``slots``, ``states``
        and ``tokens``, the step's sampled ids) proposed ``proposals[i]``, judged in
        ``verdict`` (accepted, residual; flat over the proposals). Each keeps its proposal's
        accepted prefix, then the residual draw at the first rejection or the bonus token (its
        ``tokens`` entry) after all of them. Its ``tokens`` entry becomes the first emitted
        token; returns the slots and the further tokens gained, and moves each row's computed
        count back past its rejected tokens (their KV is overwritten later)."""
        accepted, residual = verdict
        spec_slots, runs = [], []
        at = 0
        for row, proposal in zip(rows, proposals):
            k = len(proposal)
            kept = 0
            while kept < k and accepted[at + kept]:
                kept += 1
            emitted = [*proposal[:kept], residual[at + kept] if kept < k else tokens[row]]
            at += k
            tokens[row] = emitted[0]
            states[row].num_computed -= k - kept
            self.last_tokens.set(slots[row], emitted[-1])  # (its last token, should a plan ahead read it)
            spec_slots.append(slots[row])
            runs.append(emitted[1:])
        return spec_slots, runs
