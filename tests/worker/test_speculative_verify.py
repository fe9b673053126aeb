"""Rejection sampling (worker/speculative_verify.py) keeps the target's distribution exactly.

A target "model" here is a Markov chain over a small vocabulary (``P[prev]`` the distribution
of the next token), with a token no row may emit (as a filter would leave it). Many rows at
once run what the engine runs: a step verifying a proposal of two tokens (point masses from a
fixed rule, as the n-gram proposer's, or draws from a draft chain ``Q``), then, for rows that
rejected the first, a step verifying a new proposal after the token they emitted. The first
two emitted tokens must follow ``P`` jointly (chi-square); a wrong rule injected into the
same function must fail the same test.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.worker import speculative_verify
from conveyor.worker.sampler import draw_keys, race
from conveyor.worker.speculative_verify import verify_proposals

V = 6
ROWS = 20_000
START = 0  # the fixed context's last token
# 99.99% quantiles of chi-square with 4 and 24 degrees of freedom ((V - 1) and (V - 1)**2 cells, less one)
CHI2_FIRST, CHI2_JOINT = 23.51, 58.61


def target_chain(seed: int) -> torch.Tensor:
    """``[V, V]`` rows of distributions; the last token has probability 0 everywhere."""
    logits = torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 1.2
    logits[:, -1] = float("-inf")
    return logits.softmax(-1)


def draft_chain(seed: int) -> torch.Tensor:
    """A draft with full support (it proposes the target's impossible token too)."""
    return (torch.randn(V, V, generator=torch.Generator().manual_seed(seed + 100)) * 1.2).softmax(-1)


def ngram_rule(prev: torch.Tensor) -> torch.Tensor:
    """A deterministic proposer: sometimes the target's impossible token (V - 1)."""
    return (2 * prev + 1) % V


class Proposer:
    """Point masses (``draft=None``: q is None), the same point masses as a one-hot tensor, or a
    draft chain sampled with its probabilities passed."""

    def __init__(self, kind: str, seed: int) -> None:
        self.kind = kind
        self.draft = draft_chain(seed)
        self.generator = torch.Generator().manual_seed(seed + 200)

    def __call__(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.kind == "draft":
            q = self.draft[prev]
            return torch.multinomial(q, 1, generator=self.generator)[:, 0], q
        x = ngram_rule(prev)
        return x, (torch.nn.functional.one_hot(x, V).float() if self.kind == "one-hot" else None)


def emit_two(target: torch.Tensor, propose: Proposer) -> tuple[torch.Tensor, torch.Tensor]:
    """The first two tokens each row emits after ``START`` (module docstring); seeded keys
    per (row, position), as the engine draws them."""
    seeds = torch.arange(ROWS, dtype=torch.int64) * 7919 + 3
    keys = {pos: draw_keys(seeds, torch.full((ROWS,), pos, dtype=torch.int64)) for pos in (1, 2, 3)}
    context = torch.full((ROWS,), START, dtype=torch.int64)
    x1, q1 = propose(context)
    x2, q2 = propose(x1)
    draft = None if q1 is None else torch.cat([q1, q2])
    accepted, residual = verify_proposals(
        torch.cat([target[context], target[x1]]), torch.cat([x1, x2]), torch.cat([keys[1], keys[2]]), draft
    )
    a1, a2 = accepted.view(2, ROWS)
    r1, r2 = residual.view(2, ROWS)
    race(target[x2], keys[3])  # (the bonus draw: the sampler's own, it decides no test token)
    first = torch.where(a1, x1, r1)
    # rows that rejected x1: the next step verifies a new proposal after what they emitted
    y, qy = propose(first)
    a_next, r_next = verify_proposals(target[first], y, keys[2], qy)
    second = torch.where(a1, torch.where(a2, x2, r2), torch.where(a_next, y, r_next))
    return first, second


def chi_square(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's statistic over the cells the target allows; infinite if a disallowed cell
    (a token the target gives probability 0) is not empty."""
    allowed = expected > 0
    if observed[~allowed].sum() > 0:
        return float("inf")
    obs, exp = observed[allowed].double(), expected[allowed].double()
    return float(((obs - exp) ** 2 / exp).sum())


def statistics(target: torch.Tensor, kind: str, seed: int) -> tuple[float, float]:
    """Chi-square of the first emitted token and of the first two jointly against the target."""
    first, second = emit_two(target, Proposer(kind, seed))
    first_counts = torch.bincount(first, minlength=V)
    joint_counts = torch.bincount(first * V + second, minlength=V * V).view(V, V)
    p_first = target[START]
    return (
        chi_square(first_counts, ROWS * p_first),
        chi_square(joint_counts, ROWS * p_first[:, None] * target),
    )


KINDS = ["point masses", "one-hot", "draft"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_emitted_tokens_follow_the_target(kind, seed):
    first, joint = statistics(target_chain(seed), kind, seed)
    assert first < CHI2_FIRST and joint < CHI2_JOINT, (first, joint)


def _always_accept(probs, proposed, draft_probs, keys, noise, best_residual):
    return torch.ones(proposed.shape, dtype=torch.bool)


def _target_not_residual(probs, proposed, draft_probs):
    return probs


@pytest.mark.parametrize(
    "kinds, mutation",
    [
        (KINDS, ("acceptance", _always_accept)),
        # The point masses' acceptance is coupled to the race (the module docstring): there, a
        # rejection's draw from p instead of the residual is the same draw, so no mutation.
        (["one-hot", "draft"], ("residual_weights", _target_not_residual)),
    ],
    ids=["always accept", "rejection draws from p, not the residual"],
)
def test_a_wrong_rule_fails_the_same_test(monkeypatch, kinds, mutation):
    monkeypatch.setattr(speculative_verify, *mutation)
    for kind in kinds:
        first, joint = statistics(target_chain(0), kind, 0)
        assert joint > CHI2_JOINT, (kind, first, joint)


def test_greedy_accepts_exactly_the_argmax_and_emits_it_on_rejection():
    target = torch.nn.functional.one_hot(torch.tensor([3, 0, 4, 1, 2, 5]), V).float()  # point masses
    for kind in KINDS:
        first, second = emit_two(target, Proposer(kind, 0))
        assert (first == 3).all() and (second == 1).all(), kind
    proposed = torch.arange(V)
    accepted, residual = verify_proposals(target, proposed, draw_keys(proposed, proposed))
    assert accepted.tolist() == (proposed == target.argmax(-1)).tolist()
    assert residual[~accepted].tolist() == target.argmax(-1)[~accepted].tolist()


def test_point_mass_verification_emits_what_the_plain_draw_with_the_same_key_would():
    """The coupling behind seeded streams equal with and without speculation: accepted or not,
    the token emitted at a position is the race winner of its key."""
    probs = (torch.randn(500, 50, generator=torch.Generator().manual_seed(5)) * 2).softmax(-1)
    keys = draw_keys(torch.arange(500), torch.full((500,), 9))
    plain = race(probs, keys)
    proposed = torch.where(torch.arange(500) % 2 == 0, plain, (plain + 1) % 50)  # half right
    accepted, residual = verify_proposals(probs, proposed, keys)
    assert torch.equal(torch.where(accepted, proposed, residual), plain)
    assert torch.equal(accepted, proposed == plain)
