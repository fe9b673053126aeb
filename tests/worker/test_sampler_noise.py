"""The sampler's counter-based noise: the int64 splitmix64 equals the unsigned algorithm, its
exponentials follow Exp(1), and a seeded row draws the same token alone, among other rows, and
among padding rows."""

from __future__ import annotations

import random

import numpy as np
import torch

from conveyor.ipc.messages import SamplingParams
from conveyor.worker.sampler import Sampler, SamplingColumns, batch_from_rows, exponential_noise, splitmix64
from tests.worker.splitmix import U64_MASK, splitmix64_reference


def test_int64_splitmix_equals_the_unsigned_algorithm():
    rng = random.Random(0)
    values = [rng.getrandbits(64) for _ in range(2000)] + [0, 1, U64_MASK, 1 << 63, (1 << 63) - 1]
    signed = torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in values], dtype=torch.int64)
    assert [x & U64_MASK for x in splitmix64(signed).tolist()] == [splitmix64_reference(v) for v in values]


# 99.9% quantile of chi-square with 15 degrees of freedom
CHI2_CRITICAL_DF15 = 37.70


def test_noise_is_exponential_and_independent_of_neighbours():
    keys = torch.arange(64, dtype=torch.int64) * 7919  # nearby keys must not give related rows
    noise = exponential_noise(keys, 4096)
    assert noise.shape == (64, 4096) and bool((noise > 0).all()) and bool(torch.isfinite(noise).all())
    # exp(-E) is uniform on (0, 1) for E ~ Exp(1): 16 equal bins
    uniform = torch.exp(-noise.double()).flatten()
    counts = torch.histc(uniform, bins=16, min=0.0, max=1.0)
    expected = uniform.numel() / 16
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_CRITICAL_DF15
    assert abs(float(noise.double().mean()) - 1.0) < 0.01
    correlation = torch.corrcoef(torch.stack([noise[:-1].flatten(), noise[1:].flatten()]).double())[0, 1]
    assert abs(float(correlation)) < 0.01
    assert torch.equal(exponential_noise(keys[5:6], 4096), noise[5:6])  # a row depends only on its key


def draw(logits: torch.Tensor, params: list[SamplingParams], positions: list[int], sampler_seed: int) -> torch.Tensor:
    columns = SamplingColumns()
    for row, p in enumerate(params):
        columns.set(row, p)
    batch = batch_from_rows(columns.gather(np.arange(len(params))), np.asarray(positions), logits.shape[1], "cpu")
    return Sampler("cpu", seed=sampler_seed).sample(logits, batch)


def test_seeded_draw_is_the_same_alone_in_a_batch_and_padded():
    gen = torch.Generator().manual_seed(0)
    vocab = 500
    logits = torch.randn(1, vocab, generator=gen) * 2
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=77)
    mates = torch.randn(5, vocab, generator=gen) * 2
    greedy = SamplingParams(temperature=0.0)
    for position in range(12):
        alone = int(draw(logits, [seeded], [position], sampler_seed=1)[0])
        batch = torch.cat([mates[:3], logits, mates[3:]])
        params = [
            SamplingParams(temperature=1.2),
            greedy,
            SamplingParams(min_p=0.2, seed=5),
            seeded,
            SamplingParams(),
            greedy,
        ]
        in_batch = int(draw(batch, params, [3, 9, position, position, 0, 1], sampler_seed=position)[3])
        padded = draw(
            torch.cat([logits, torch.zeros(3, vocab)]), [seeded, greedy, greedy, greedy], [position, 0, 0, 0], 2
        )
        assert alone == in_batch == int(padded[0]), position
        assert padded[1:].tolist() == [0, 0, 0]  # padding rows: greedy over zeros


def test_uniforms_at_the_extreme_buckets_stay_inside_0_1_in_float32() -> None:
    """The top and bottom buckets' midpoints must be float32 values strictly inside (0, 1): a
    uniform that rounds to 1.0 gives exponential noise 0, and a token of weight 0 then races
    as 0 / 0 = NaN, which argmax picks (a masked token drawn). Their noise is finite and > 0."""
    from conveyor.worker.sampler import _NOISE_BITS

    extremes = torch.tensor([0, (1 << _NOISE_BITS) - 1], dtype=torch.int64)
    u = (extremes.to(torch.float32) + 0.5) * (1.0 / (1 << _NOISE_BITS))
    assert bool((u > 0).all()) and bool((u < 1).all()), u
    noise = u.log().neg()
    assert bool(torch.isfinite(noise).all()) and bool((noise > 0).all()), noise
