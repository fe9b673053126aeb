"""Sampler: exact greedy, filters that never let a disallowed token through, distributions
that match the softmax, and seeded draws that depend only on (seed, position, logits)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from conveyor.ipc.messages import SamplingParams
from conveyor.worker.sampler import Sampler, draw_keys
from tests.worker.splitmix import U64_MASK, splitmix64_reference

GREEDY = SamplingParams(temperature=0.0)


def sample(logits: torch.Tensor, params: SamplingParams | list[SamplingParams], positions=None, seed=0) -> torch.Tensor:
    rows = logits.shape[0]
    params = params if isinstance(params, list) else [params] * rows
    return Sampler("cpu", seed=seed)(logits, params, positions if positions is not None else [0] * rows)


def random_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = random_logits(16, 1000)
    assert torch.equal(sample(logits, GREEDY), logits.argmax(-1))


def test_top_k_one_is_greedy():
    logits = random_logits(16, 1000)
    assert torch.equal(sample(logits, SamplingParams(temperature=1.3, top_k=1)), logits.argmax(-1))


def test_mixed_batch_keeps_greedy_rows_exact():
    logits = random_logits(6, 50)
    params = [GREEDY, SamplingParams(temperature=1.0), GREEDY, SamplingParams(top_p=0.5), GREEDY, GREEDY]
    out = sample(logits, params)
    greedy_rows = [0, 2, 4, 5]
    assert torch.equal(out[greedy_rows], logits.argmax(-1)[greedy_rows])


def test_seeded_draws_ignore_batch_mates_and_order():
    logits = random_logits(1, 200, seed=3)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [int(sample(logits, seeded, [pos], seed=1)) for pos in range(20)]
    mates = random_logits(4, 200, seed=4)
    for pos in range(20):
        batch = torch.cat([mates[:2], logits, mates[2:]])
        params = [SamplingParams(), SamplingParams(seed=9), seeded, GREEDY, SamplingParams(top_k=3)]
        out = sample(batch, params, [7, pos, pos, 0, 3], seed=pos + 100)
        assert int(out[2]) == alone[pos]
    assert len(set(alone)) > 5, "different positions must draw differently"
    assert alone != [int(sample(logits, SamplingParams(seed=1235), [pos])) for pos in range(20)]


def test_splitmix64_reference_gives_the_published_stream():
    """The first two outputs of splitmix64 seeded with 0, as published with the algorithm."""
    assert splitmix64_reference(0) == 0xE220A8397B1DCDAF
    assert splitmix64_reference(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4


KEY_SCRIPT = """
import json, sys, torch
from conveyor.worker.sampler import draw_keys
seeds, positions = json.loads(sys.stdin.read())
print(json.dumps(draw_keys(torch.tensor(seeds), torch.tensor(positions)).tolist()))
"""


def test_draw_keys_are_the_reference_hash_in_every_process():
    """A seeded draw must be reproducible across processes and releases: the keys of a fresh
    interpreter equal this one's, and both equal splitmix64(splitmix64(seed) ^ position)
    computed on unsigned ints (as int64 bit patterns), seeds up to 2**63 - 1 included."""
    seeds = [s for s in range(30) for _ in range(30)] + [2**63 - 1, 2**40 + 7]
    positions = [p for _ in range(30) for p in range(30)] + [5, 2**20]
    keys = draw_keys(torch.tensor(seeds), torch.tensor(positions)).tolist()
    fresh = subprocess.run(
        [sys.executable, "-c", KEY_SCRIPT],
        input=json.dumps([seeds, positions]),
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(fresh.stdout) == keys
    reference = [splitmix64_reference(splitmix64_reference(s) ^ p) for s, p in zip(seeds, positions)]
    assert [k & U64_MASK for k in keys] == reference
    assert len(set(keys)) == len(keys)


PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])


@pytest.mark.parametrize(
    "params,allowed",
    [
        (SamplingParams(top_p=0.6), {0, 1}),  # 0.4 before token 1 < 0.6; 0.65 before token 2
        (SamplingParams(top_p=0.3), {0}),
        (SamplingParams(min_p=0.3), {0, 1, 2}),  # threshold 0.12
        (SamplingParams(top_k=4, top_p=0.85), {0, 1, 2}),  # renormalized top 4: 0.72 before token 2, 0.89 before 3
        (SamplingParams(top_k=3, min_p=0.5), {0, 1}),  # threshold 0.2
        (SamplingParams(top_k=2), {0, 1}),
    ],
)
def test_filters_never_sample_outside_the_allowed_set(params, allowed):
    logits = PROBS.log().repeat(4000, 1)
    drawn = set(sample(logits, params).tolist())
    assert drawn == allowed
    seeded = [SamplingParams(top_k=params.top_k, top_p=params.top_p, min_p=params.min_p, seed=s) for s in range(300)]
    assert set(sample(logits[:300], seeded).tolist()) <= allowed


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


# 99.9% quantile of chi-square with 7 degrees of freedom
CHI2_CRITICAL_DF7 = 24.32


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_temperature_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.3, 2.0, 0.1, -1.0, 0.7])
    expected = (logits / temperature).softmax(-1)
    unseeded = sample(logits.repeat(20000, 1), SamplingParams(temperature=temperature), seed=5)
    assert chi_square(unseeded, expected) < CHI2_CRITICAL_DF7
    # Seeded rows draw with their own generators: across seeds they must follow the same law.
    seeded = sample(logits.repeat(2000, 1), [SamplingParams(temperature=temperature, seed=s) for s in range(2000)])
    assert chi_square(seeded, expected) < CHI2_CRITICAL_DF7
    assert math.isclose(float(expected.sum()), 1.0, rel_tol=1e-6)
