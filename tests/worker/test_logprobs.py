"""Log-probabilities computed by the runner, against HF transformers' log-softmax of the same
sequence: the sampled tokens' (ragged and static decode steps), the top k's ids and order, and
the prompt's (chunked prefill: each chunk gives its positions; the first token has none)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.ipc.messages import NewRequestData, SamplingParams, StepLogprobs
from conveyor.runtime.config import RunnerConfig
from conveyor.worker.model_runner import ModelRunner
from tests.plans import CachedRow, plan


def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), V]``: row ``p`` is the float32 log-softmax predicting token ``p + 1``."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return logits.log_softmax(-1)


def rows_of(lp: StepLogprobs, slot: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(start, token logprobs [n], top ids [n, w], top logprobs [n, w]) of ``slot``'s rows."""
    slots = np.asarray(lp.slots)
    i = int(np.flatnonzero(slots == slot)[0])
    counts = np.asarray(lp.counts)
    first, n = int(counts[:i].sum()), int(counts[i])
    chosen = np.frombuffer(lp.token_logprobs, "<f4")[first : first + n]
    ids = np.asarray(lp.top_ids).reshape(-1, lp.width)[first : first + n]
    top = np.frombuffer(lp.top_logprobs, "<f4").reshape(-1, lp.width)[first : first + n]
    return int(np.asarray(lp.starts)[i]), chosen, ids, top


def check_row(
    reference: torch.Tensor, token: int, chosen: float, ids: np.ndarray, top: np.ndarray, k: int, tol: float = 1e-4
) -> None:
    """One position against the reference row: the token's value, the top k's values in
    order and their ids (ties compared as sets of ids with equal values)."""
    assert chosen == pytest.approx(reference[token].item(), abs=tol)
    assert len(ids) == k
    values, _ = reference.topk(k)
    np.testing.assert_allclose(top, values.numpy(), atol=tol)
    np.testing.assert_allclose(reference[torch.from_numpy(ids.astype(np.int64))].numpy(), top, atol=tol)
    assert len(set(ids.tolist())) == k


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])  # cuda: the decode steps replay CUDA graphs
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_match_hf_through_chunked_prefill_and_decode(checkpoint_factory, temperature, device):
    directory, model = checkpoint_factory("llama")
    runner = ModelRunner(
        RunnerConfig(
            directory,
            device=device,
            dtype="float32",
            block_size=4,
            num_blocks=32,
            max_num_seqs=8,
        ),
    )
    tol = 1e-4 if device == "cpu" else 1e-3
    asks = SamplingParams(temperature=temperature, seed=7, logprobs=5, prompt_logprobs=3)
    quiet = SamplingParams(temperature=0.0)
    prompt = [5, 9, 17, 33, 2, 60, 61, 8, 100]
    other = [7, 7, 3]
    # a: 9-token prompt in chunks of 4 and 5, with b (no logprobs) in the same steps.
    results = [
        runner.execute(
            plan(
                0,
                [
                    NewRequestData("a", 0, prompt, asks, [0, 1, 2], 0, 4, len(prompt)),
                    NewRequestData("b", 1, other, quiet, [3, 5], 0, 3, len(other)),
                ],
            )
        )
    ]
    results.append(runner.execute(plan(1, cached=[CachedRow(0, [], 4, 5), CachedRow(1, [], 3, 1)])))
    for step in range(2, 6):  # decodes: the static step
        n = len(prompt) + step - 2
        results.append(
            runner.execute(
                plan(step, cached=[CachedRow(0, [4] if n == 12 else [], n, 1), CachedRow(1, [], 2 + step, 1)])
            )
        )
    assert all(r.error is None for r in results)
    sampled = [tok for r in results for slot, tok in zip(r.slots, r.sampled_token_ids) if slot == 0]
    assert len(sampled) == 5
    reference = hf_logprobs(model, prompt + sampled)

    # The prompt: chunk 1 (positions 0..3) predicts tokens 1..4, chunk 2 (4..8) tokens 5..8
    # (its last position predicts the first output); the first token has none.
    first = results[0].prompt_logprobs
    start, chosen, ids, top = rows_of(first, 0)
    assert (start, len(chosen)) == (1, 4) and list(np.asarray(first.slots)) == [0]
    start2, chosen2, ids2, top2 = rows_of(results[1].prompt_logprobs, 0)
    assert (start2, len(chosen2)) == (5, 4)
    assert all(r.prompt_logprobs is None for r in results[2:])
    for index, value, row_ids, row_top in zip(
        range(1, len(prompt)),
        np.concatenate([chosen, chosen2]),
        np.concatenate([ids, ids2]),
        np.concatenate([top, top2]),
    ):
        check_row(reference[index - 1], prompt[index], float(value), row_ids, row_top, 3, tol)

    # The sampled tokens, one per step from the end of the prompt on; b asked for none.
    for n, result in enumerate(results[1:]):
        assert list(np.asarray(result.logprobs.slots)) == [0]
        start, chosen, ids, top = rows_of(result.logprobs, 0)
        index = len(prompt) + n
        assert start == index
        check_row(reference[index - 1], sampled[n], float(chosen[0]), ids[0], top[0], 5, tol)
    if temperature == 0.0:  # greedy takes the most likely token, the top-1
        assert all(rows_of(r.logprobs, 0)[2][0][0] == tok for r, tok in zip(results[1:], sampled))


def test_a_step_nobody_asks_computes_none(llama_dir):
    runner = ModelRunner(RunnerConfig(llama_dir, block_size=4, num_blocks=16))
    params = SamplingParams(temperature=0.0)
    first = runner.execute(plan(0, [NewRequestData("a", 0, [1, 2, 3], params, [0], 0, 3, 3)]))
    second = runner.execute(plan(1, cached=[CachedRow(0, [], 3, 1)]))
    assert first.logprobs is None and first.prompt_logprobs is None and second.logprobs is None
    # A k of 0 asks for the sampled token's alone.
    runner.execute(
        plan(
            2, [NewRequestData("z", 2, [4, 5], SamplingParams(temperature=0.0, logprobs=0), [1], 0, 2, 2)], finished=[0]
        )
    )
    third = runner.execute(plan(3, cached=[CachedRow(2, [], 2, 1)]))
    assert third.logprobs.width == 0 and len(np.frombuffer(third.logprobs.token_logprobs, "<f4")) == 1
