"""Sampling controls on the device (penalties, logit_bias, min_tokens) against their float32
definition written out per row, the pool's row reuse, and the counts a sampled token adds."""

from __future__ import annotations

import numpy as np
import torch

from conveyor.ipc.messages import SamplingParams
from conveyor.worker.sampler import Sampler, SamplingColumns, batch_from_rows
from conveyor.worker.sampling_controls import SamplingControls

VOCAB = 40
EOS = [3, 7]


def reference(
    logits: torch.Tensor, p: SamplingParams, tokens: list[int], num_prompt: int, position: int
) -> torch.Tensor:
    """vLLM's definitions, one row, float32, token by token."""
    row = logits.clone()
    for token, bias in p.logit_bias.items():
        row[token] += bias
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(EOS))
    if position < num_prompt + p.min_tokens:
        for token in stops:
            row[token] = float("-inf")
    output = tokens[num_prompt:]
    for token in range(VOCAB):
        count = output.count(token)
        if token in tokens:
            r = p.repetition_penalty
            row[token] = row[token] / r if row[token] > 0 else row[token] * r
        row[token] -= p.frequency_penalty * count
        row[token] -= p.presence_penalty * (count > 0)
    return row


CASES = [
    (SamplingParams(temperature=0.0), [1, 2, 2, 5], 2),  # no control: untouched
    (SamplingParams(presence_penalty=1.5, frequency_penalty=-0.5), [1, 2, 2, 5, 5, 5, 9], 2),
    (SamplingParams(repetition_penalty=1.7), [4, 4, 11, 12, 30], 3),
    (SamplingParams(repetition_penalty=0.6, presence_penalty=-2.0, frequency_penalty=2.0), [8, 0, 8, 8, 1], 1),
    (SamplingParams(logit_bias={0: 100.0, 39: -100.0, 5: 2.5}), [6, 6], 2),
    (SamplingParams(min_tokens=3, stop_token_ids=[20]), [1, 2, 3], 2),  # masked: 1 of 3 out
    (SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[20]), [1, 2, 3], 2),  # only 20 masked
    (SamplingParams(min_tokens=1, logit_bias={3: 50.0}), [1, 2, 3], 2),  # past min_tokens: bias only
    (SamplingParams(min_tokens=4, repetition_penalty=0.5, frequency_penalty=1.0), [3, 7, 1, 3, 3], 2),  # -inf stays
]


def controlled(logits: torch.Tensor, cases, eos=EOS) -> torch.Tensor:
    controls = SamplingControls(VOCAB, "cpu", eos)
    positions = np.array([len(tokens) for _, tokens, _ in cases], np.int64)
    for slot, (p, tokens, num_prompt) in enumerate(cases):
        controls.assign(slot, p, tokens, num_prompt)
    rows = controls.upload(controls.select(np.arange(len(cases)), positions))
    return rows.apply(logits, torch.from_numpy(positions))


def test_every_control_matches_its_definition():
    logits = torch.randn(len(CASES), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    out = controlled(logits, CASES)
    for i, (p, tokens, num_prompt) in enumerate(CASES):
        expected = reference(logits[i], p, tokens, num_prompt, len(tokens))
        assert torch.equal(out[i], expected), f"case {i}: {p}"
    assert torch.equal(out[0], logits[0])  # an uncontrolled row is left bit for bit


def test_no_controlled_row_selects_nothing():
    controls = SamplingControls(VOCAB, "cpu", EOS)
    assert controls.select(np.arange(2), np.array([5, 5])) is None  # nothing held: no work at all
    controls.assign(1, SamplingParams(min_tokens=2), [1, 2, 3], 3)
    assert controls.select(np.array([0]), np.array([5])) is None  # the controlled slot is not sampling
    assert controls.select(np.array([1]), np.array([5])) is None  # past its min_tokens: nothing to do
    assert controls.select(np.array([1]), np.array([4])).any_min_tokens


def test_a_reused_pool_row_forgets_its_last_holder():
    controls = SamplingControls(VOCAB, "cpu", EOS)
    controls.assign(0, SamplingParams(logit_bias={9: 100.0}, min_tokens=5), [1, 2], 2)
    controls.release([0])
    controls.assign(4, SamplingParams(frequency_penalty=1.0), [1, 2, 9], 2)  # takes the freed row
    assert controls.row_of_slot[4] == 0 and controls.held == 1
    logits = torch.zeros(1, VOCAB)
    rows = controls.upload(controls.select(np.array([4]), np.array([3])))
    out = rows.apply(logits, torch.tensor([3]))
    expected = torch.zeros(VOCAB)
    expected[9] = -1.0  # its own output token counted once; no bias, no stop mask left over
    assert torch.equal(out[0], expected)


def test_sampled_tokens_are_counted_for_the_next_step():
    """Greedy under a large frequency penalty: the token drawn first is penalized next time,
    through the count the first draw recorded on the device."""
    controls = SamplingControls(VOCAB, "cpu", EOS)
    controls.assign(0, SamplingParams(temperature=0.0, frequency_penalty=2.0), [1], 1)
    logits = torch.zeros(1, VOCAB)
    logits[0, 10], logits[0, 11] = 5.0, 4.0
    sampler = Sampler("cpu", seed=0)
    columns = SamplingColumns()
    columns.set(0, SamplingParams(temperature=0.0))
    drawn = []
    for position in (1, 2, 3):
        rows = controls.upload(controls.select(np.array([0]), np.array([position])))
        batch = batch_from_rows(columns.gather(np.array([0])), np.array([position]), VOCAB, "cpu", rows)
        drawn.append(int(sampler.sample(logits, batch)[0]))
    # 10 (5 > 4), then 11 (10 is at 5 - 2 = 3 < 4), then 10 (3 > 11's 4 - 2).
    assert drawn == [10, 11, 10]
    assert controls.dense["counts"][0, 10] == 2 and controls.dense["counts"][0, 11] == 1


def test_min_tokens_through_the_sampler_never_draws_a_stop_id():
    logits = torch.zeros(4, VOCAB)
    logits[:, EOS[0]] = 50.0  # EOS would win every draw
    params = [SamplingParams(temperature=1.0, min_tokens=2, seed=s) for s in range(4)]
    histories = [([5, 6], 2)] * 4
    out = Sampler("cpu", seed=0)(logits, params, [2, 3, 4, 3], histories, eos_token_ids=EOS)
    assert [t == EOS[0] for t in out.tolist()] == [False, False, True, False]
