"""Verification of a step's speculative rows: rejection sampling, on the device, batched.

A speculative row runs its last known token and a proposal ``x_1 .. x_k``; the LM head scores
its ``k + 1`` positions. Position ``j`` (0-based, ``j < k``) gives the target's distribution
``p_j`` of the token at sequence position ``num_computed + 1 + j``, which ``x_{j+1}`` claims;
the last position is the row's ordinary sampled row (the *bonus* draw). ``p_j`` is
:meth:`~conveyor.worker.sampler.Sampler.distribution` of those logits with the request's
parameters: temperature, top-k, top-p, min-p exactly as a plain draw, greedy a point mass at
the argmax. (Requests with penalties, logit bias, ``min_tokens``, a grammar or
log-probabilities never speculate: ``scheduler/speculation.py``.)

**The rule** (:func:`verify_proposals`, all proposed positions of a step at once): ``x`` is
accepted with probability ``min(1, p(x) / q(x))``, where ``q`` is the distribution the
proposer drew ``x`` from; at the first rejection the row emits a draw from the residual
``norm(max(0, p - q))`` and stops; after ``k`` accepts it emits the bonus draw. Every emitted
token is then distributed exactly as the target's (the standard argument: for each ``y``,
``q(y) min(1, p(y)/q(y)) + (1 - sum min(p, q)) * max(0, p(y) - q(y)) / sum max(0, p - q)
= p(y)``). Greedy is the case of point-mass ``p``: ``x`` is accepted iff it is the argmax,
else the argmax is emitted, token for token what decoding without speculation gives.

**q, the interface for proposers.** ``draft_probs=None`` means point masses (the n-gram
proposer: ``q`` is 1 at ``x``): accept with probability ``p(x)``, residual ``p`` with ``x``
zeroed. A draft model passes ``draft_probs``: float32 ``[num_proposed, vocab]`` on the
device, row ``i`` the distribution its proposed token ``i`` was drawn from (after the draft's
own temperature and filters, so ``q(x) > 0``), rows in the step's flat proposal order:
speculative rows in step order, each proposal's tokens in order (the order of
``CachedRequests.spec_token_ids``). :meth:`SpeculativeVerify._verify_proposals` takes it.

**Randomness.** Each proposed position draws with the key of its sequence position
(:meth:`~conveyor.worker.sampler.Sampler.keys`: ``draw_keys(seed, position)`` for a seeded
request, the sampler's generator otherwise); the residual draw is the exponential race with
that key's noise, the acceptance uniform (general ``q``) is element 0 of the key's stream,
the noise's elements 1.. . So everything a seeded request draws is a function of (seed,
position): the same seed, prompt and server configuration give the same tokens. For point
masses the acceptance is *coupled* to the race: ``x`` is accepted iff it wins
``argmax(p / E)`` (probability ``p(x)``), and a loser's winner is the residual's draw, since
zeroing ``x`` does not change who wins when ``x`` did not. The token emitted at a position is
then always the race winner a plain draw with the same key would give: a seeded n-gram
request emits the same stream with and without speculation, up to float differences between
a position scored in a verification pass and in a one-token decode (a near-tie may then
fall the other way; the streams are not promised to be equal). A draft model's ``q`` uses an
independent uniform; its stream differs from the plain one.

The logits come from the step's LM head call, the ragged step's or the static decode-verify
step's (:mod:`conveyor.worker.decode_step`), both through
:meth:`SpeculativeVerify._verify_proposals`. With tensor parallelism only rank 0 holds the
LM head: it broadcasts the verdict (:meth:`SpeculativeVerify._shared_verdict`) and every rank
accepts the same tokens.

The host part (:meth:`SpeculativeVerify._accept`, at the step's finish) is a small loop
over rows: the accepted length, the emitted tokens, the computed count moved back past the
rejected tokens (their KV is overwritten later).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from conveyor.worker.parallel import broadcast_from_first_
from conveyor.worker.sampler import batch_from_rows, exponential_noise, stream_uniforms

if TYPE_CHECKING:
    from conveyor.worker.model_runner import LaunchedStep
    from conveyor.worker.request_state import Work


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
    """Rejection sampling of ``R`` proposed tokens at once (module docstring): ``probs``
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
    """The speculative-decoding verification of a runner (a base class of
    :class:`~conveyor.worker.model_runner.ModelRunner`: it reads the runner's sampler,
    per-slot sampling columns, last tokens and tensor-parallel rank; module docstring)."""

    def _verify_proposals(
        self, logits: torch.Tensor, work: list[Work], slots: np.ndarray, draft_probs: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Enqueue the verification of the step's speculative rows: ``logits`` ``[R, V]`` the
        target's at every proposed position, rows in flat proposal order. Returns int64
        ``[2, R]`` on the device: accepted (0/1) and the residual draw of each position."""
        spec = [i for i, item in enumerate(work) if item.proposal]
        lengths = [len(work[i].proposal) for i in spec]
        # The token position each logits row draws: after the row's last known token.
        positions = np.concatenate(
            [np.arange(1, n + 1, dtype=np.int64) + work[i].num_computed for i, n in zip(spec, lengths)]
        )
        rows = self._sampling.gather(np.repeat(slots[spec], lengths))
        batch = batch_from_rows(rows, positions, logits.shape[1], logits.device)
        proposed = torch.tensor([t for i in spec for t in work[i].proposal], dtype=torch.int64)
        proposed = proposed.to(logits.device, non_blocking=True)
        if batch.all_greedy:  # the rule on point masses made fast: keep x iff the argmax, else emit it
            target = logits.argmax(dim=-1)
            return torch.stack([(proposed == target).to(torch.int64), target])
        keys = self.sampler.keys(batch)
        accepted, residual = verify_proposals(self.sampler.distribution(logits, batch), proposed, keys, draft_probs)
        return torch.stack([accepted.to(torch.int64), residual])

    def _shared_verdict(self, verdict: torch.Tensor | None, count: int) -> torch.Tensor:
        """Rank 0's verdict on the step's ``count`` proposed tokens on every rank of a
        tensor-parallel group (``verdict``: this rank's, None where it holds no LM head), so
        that every rank accepts the same tokens and keeps the same request state; the same
        tensor at size 1."""
        if self.tensor_parallel.size == 1:
            return verdict
        if verdict is None:
            verdict = torch.empty(2, count, dtype=torch.int64, device=self.device)
        return broadcast_from_first_(verdict, self.tensor_parallel)

    def _accept(self, launched: LaunchedStep, tokens: list[int]) -> tuple[list[int], list[list[int]]]:
        """The host's part, at the finish: each speculative row keeps its proposal's accepted
        prefix, then the residual draw at the first rejection or the bonus token (its
        ``tokens`` entry, the sampled row) after all of them. Its ``tokens`` entry becomes
        the first emitted token; returns the slots and the further tokens gained, and moves
        each row's computed count back past its rejected tokens."""
        accepted, residual = launched.spec_verdict.tolist()
        slots, runs = [], []
        at = 0
        for row, proposal in zip(launched.spec_rows, launched.spec_proposals):
            k = len(proposal)
            kept = 0
            while kept < k and accepted[at + kept]:
                kept += 1
            emitted = [*proposal[:kept], residual[at + kept] if kept < k else tokens[row]]
            at += k
            tokens[row] = emitted[0]
            launched.states[row].num_computed -= k - kept
            slot = launched.slots[row]
            with torch.inference_mode():  # (its last token, should a plan ahead read it)
                self._last_tokens[slot] = emitted[-1]
            slots.append(slot)
            runs.append(emitted[1:])
        return slots, runs
