"""Log-probabilities through a served model, checked against HF transformers' log-softmax:
over ZeroMQ (the client protocol's columns, whole and streamed) and over HTTP in OpenAI's
shapes (the official client: completions and chat, whole and streamed, echo, prompt_logprobs)."""

from __future__ import annotations

import pytest
import torch

from conveyor.client import Client

PROMPT_IDS = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


def reference(model, tokens: list[int]) -> torch.Tensor:
    """Row ``p``: HF's float32 log-softmax of the logits predicting token ``p + 1``."""
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def check_columns(columns: dict, ref: torch.Tensor, tokens: list[int], k: int) -> None:
    """Protocol columns from index ``columns['start']`` against the reference of ``tokens``."""
    start = columns["start"]
    n = len(columns["token_logprobs"])
    assert n and len(columns["top_token_ids"]) == n and len(columns["tokens"]) == n
    for i in range(n):
        row = ref[start + i - 1]
        assert columns["token_logprobs"][i] == pytest.approx(row[tokens[start + i]].item(), abs=1e-4)
        values = row.topk(k).values.tolist()
        assert columns["top_logprobs"][i] == pytest.approx(values, abs=1e-4)
        assert [row[t].item() for t in columns["top_token_ids"][i]] == pytest.approx(values, abs=1e-4)
        assert len(columns["top_tokens"][i]) == k


def joined(parts: list[dict]) -> dict:
    """Consecutive deltas' columns as one."""
    out = {key: [] for key in ("tokens", "token_logprobs", "top_token_ids", "top_tokens", "top_logprobs")}
    for i, part in enumerate(parts):
        if i:
            assert part["start"] == out["start"] + len(out["token_logprobs"])
        else:
            out["start"] = part["start"]
        for key in out:
            if key != "start":
                out[key] += part[key]
    return out


def test_zmq_logprobs_whole_and_streamed(http_server, hf_model) -> None:
    request = dict(token_ids=PROMPT_IDS, max_tokens=6, temperature=0.8, seed=11, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    with Client(http_server.address, timeout=60) as client:
        whole = client.generate(**request)
        deltas = list(client.stream(**request))
        refused = client.generate(token_ids=PROMPT_IDS, logprobs=21)
        plain = client.generate(token_ids=PROMPT_IDS, max_tokens=2)
    assert plain.logprobs is None and plain.prompt_logprobs is None
    assert refused.finish_reason == "error" and "max-logprobs" in refused.error
    sequence = PROMPT_IDS + whole.token_ids
    ref = reference(hf_model, sequence)
    assert whole.logprobs["start"] == len(PROMPT_IDS) and len(whole.logprobs["token_logprobs"]) == 6
    check_columns(whole.logprobs, ref, sequence, 3)
    assert whole.prompt_logprobs["start"] == 1 and len(whole.prompt_logprobs["token_logprobs"]) == len(PROMPT_IDS) - 1
    check_columns(whole.prompt_logprobs, ref, sequence, 2)
    # streamed: the same seed gives the same tokens; the deltas' pieces add up to the final's
    result = deltas[-1].result
    assert result.token_ids == whole.token_ids and result.logprobs == whole.logprobs
    assert joined([d.logprobs for d in deltas if d.logprobs]) == whole.logprobs
    assert joined([d.prompt_logprobs for d in deltas if d.prompt_logprobs]) == whole.prompt_logprobs
