"""Fixtures that run bin/serve as a user would: a real subprocess tree on a real checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.e2e.serve_harness import ServeProcess

if TYPE_CHECKING:
    import torch


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The serving tests' tiny random Llama (tests/checkpoints.py: position-sensitive), with
    the demo tokenizer beside it."""
    from tests.checkpoints import serving_checkpoint

    return serving_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def draft_checkpoint(tmp_path_factory, tiny_checkpoint) -> Path:
    """A smaller random Llama of the tiny checkpoint's vocabulary: a speculative-decoding draft
    that mostly disagrees with it."""
    from tests.checkpoints import draft_checkpoint

    return draft_checkpoint(tmp_path_factory.mktemp("draft-llama"), tiny_checkpoint)


@pytest.fixture
def serve_factory(tmp_path):
    """Start bin/serve with given flags; every server started is torn down and checked for orphans."""
    started: list[ServeProcess] = []

    def start(*args: str) -> ServeProcess:
        server = ServeProcess(list(args), tmp_path)
        started.append(server)
        return server

    yield start
    for server in started:
        server.shut_down(list(server.pids.values()))


@pytest.fixture(scope="session")
def hf_greedy(tiny_checkpoint):
    """Greedy continuation by HF transformers, one prompt at a time (the reference).

    EOS neither stops nor is suppressed (as with ``ignore_eos``). Greedy continuations of a
    prompt are prefixes of each other, so the longest one computed per prompt is kept and cut."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    longest: dict[tuple[int, ...], list[int]] = {}

    def run(prompt_ids: list[int], n: int) -> list[int]:
        key = tuple(prompt_ids)
        if len(longest.get(key, ())) < n:
            with torch.inference_mode():
                ids = torch.tensor([prompt_ids])
                # An explicit mask: BOS is id 0 here, and generate() would take it for padding.
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
                )
            longest[key] = out[0, len(prompt_ids) :].tolist()
        return longest[key][:n]

    return run


@pytest.fixture(scope="session")
def hf_logprobs(tiny_checkpoint):
    """HF transformers' float32 log-softmax over a token sequence (the log-probability
    reference): row ``p`` is the distribution of token ``p + 1``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()

    def run(tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)

    return run


@pytest.fixture(scope="session")
def hf_pooled(tiny_checkpoint):
    """HF transformers' AutoModel (the decoder without its LM head) on the tiny checkpoint: its
    last hidden state (after the final norm) pooled (``last`` or ``mean``) and L2-normalized,
    the embeddings' reference."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()

    def run(tokens: list[int], pooling: str) -> torch.Tensor:
        with torch.inference_mode():
            hidden = model(torch.tensor([tokens])).last_hidden_state[0].float()
        return torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=0)

    return run


class PresenceFrequency:
    """vLLM's (OpenAI's) presence / frequency penalties over the output tokens, float32."""

    def __init__(self, num_prompt: int, presence: float, frequency: float) -> None:
        self.num_prompt, self.presence, self.frequency = num_prompt, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import torch

        counts = torch.zeros_like(scores)
        output = input_ids[:, self.num_prompt :]
        counts.scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.fixture(scope="session")
def hf_controlled(tiny_checkpoint):
    """Greedy tokens of the tiny checkpoint under the processors a request's controls name,
    in the sampler's order (bias, min_tokens, repetition, presence / frequency); stops after
    an id in ``stop`` (none: runs ``n`` tokens)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.logits_process import (
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()

    def run(prompt: list[int], n: int, stop=(), **controls) -> list[int]:
        processors = []
        if controls.get("logit_bias"):
            processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in controls["logit_bias"].items()}))
        if controls.get("min_tokens"):
            processors.append(MinNewTokensLengthLogitsProcessor(len(prompt), controls["min_tokens"], list(stop)))
        if controls.get("repetition_penalty", 1.0) != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(controls["repetition_penalty"]))
        if controls.get("presence_penalty") or controls.get("frequency_penalty"):
            presence, frequency = controls.get("presence_penalty", 0.0), controls.get("frequency_penalty", 0.0)
            processors.append(PresenceFrequency(len(prompt), presence, frequency))
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            for _ in range(n):
                scores = model(ids).logits[:, -1].float()
                for processor in processors:
                    scores = processor(ids, scores)
                token = int(scores.argmax(-1))
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
                if token in stop:
                    break
        return ids[0, len(prompt) :].tolist()

    return run


@pytest.fixture(scope="session")
def hf_greedy_check(real_hf_logprobs):
    """``f([(prompt ids, output ids), ...])``: the pairs whose output is not transformers'
    greedy continuation (teacher-forced: each output token must be its argmax at that point,
    exactly when ``generate`` would pick them one by one); [] when all are."""

    def check(pairs: list[tuple[list[int], list[int]]]) -> list[int]:
        logprobs = real_hf_logprobs([list(prompt) + list(output) for prompt, output in pairs])
        wrong = []
        for i, (prompt, output) in enumerate(pairs):
            start = len(prompt)
            if not output or logprobs[i, start - 1 : start - 1 + len(output)].argmax(dim=-1).tolist() != list(output):
                wrong.append(i)
        return wrong

    return check
