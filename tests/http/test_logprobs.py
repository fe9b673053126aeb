"""Log-probabilities through a served model, checked against HF transformers' log-softmax:
over ZeroMQ (the client protocol's columns, whole and streamed) and over HTTP in OpenAI's
shapes (the official client: completions and chat, whole and streamed, echo, prompt_logprobs)."""

from __future__ import annotations

import pytest
import torch

from conveyor.client import Client

PROMPT_IDS = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]


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


def test_zmq_logprobs_whole_and_streamed(http_server, hf_logprobs) -> None:
    request = dict(
        token_ids=PROMPT_IDS, max_tokens=6, temperature=0.8, seed=11, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    with Client(http_server.address, timeout=60) as client:
        whole = client.generate(**request)
        deltas = list(client.stream(**request))
        refused = client.generate(token_ids=PROMPT_IDS, logprobs=21)
        plain = client.generate(token_ids=PROMPT_IDS, max_tokens=2)
    assert plain.logprobs is None and plain.prompt_logprobs is None
    assert refused.finish_reason == "error" and "max-logprobs" in refused.error
    sequence = PROMPT_IDS + whole.token_ids
    ref = hf_logprobs(sequence)
    assert whole.logprobs["start"] == len(PROMPT_IDS) and len(whole.logprobs["token_logprobs"]) == 6
    check_columns(whole.logprobs, ref, sequence, 3)
    assert whole.prompt_logprobs["start"] == 1 and len(whole.prompt_logprobs["token_logprobs"]) == len(PROMPT_IDS) - 1
    check_columns(whole.prompt_logprobs, ref, sequence, 2)
    # streamed: the same seed gives the same tokens; the deltas' pieces add up to the final's
    result = deltas[-1].result
    assert result.token_ids == whole.token_ids and result.logprobs == whole.logprobs
    assert joined([d.logprobs for d in deltas if d.logprobs]) == whole.logprobs
    assert joined([d.prompt_logprobs for d in deltas if d.prompt_logprobs]) == whole.prompt_logprobs


# ------------------------------------------------------------------ HTTP, the official client


def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def model_of(server) -> str:
    return openai_client(server).models.list().data[0].id


def test_completions_logprobs_whole_streamed_and_echoed(http_server, hf_logprobs) -> None:
    client, model = openai_client(http_server), model_of(http_server)
    common = dict(model=model, prompt=PROMPT_IDS, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(logprobs=3, **common).choices[0]
    lp = whole.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    with Client(http_server.address, timeout=60) as zmq_client:
        ids = zmq_client.generate(token_ids=PROMPT_IDS, max_tokens=5, temperature=0, ignore_eos=True).token_ids
    ref = hf_logprobs(PROMPT_IDS + ids)
    for i, token_id in enumerate(ids):
        row = ref[len(PROMPT_IDS) + i - 1]
        assert lp.token_logprobs[i] == pytest.approx(row[token_id].item(), abs=1e-4)
        # the top 3 and the chosen token (greedy: among them), keyed by text (texts may collide)
        assert 1 <= len(lp.top_logprobs[i]) <= 3 and lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i]
        assert max(lp.top_logprobs[i].values()) == pytest.approx(row.max().item(), abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert "".join(lp.tokens) == whole.text

    chunks = [c.choices[0] for c in client.completions.create(logprobs=3, stream=True, **common) if c.choices]
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(lp.token_logprobs)
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset

    echoed = client.completions.create(logprobs=2, echo=True, **common).choices[0].logprobs
    assert len(echoed.tokens) == len(PROMPT_IDS) + 5
    assert echoed.token_logprobs[0] is None and echoed.top_logprobs[0] is None
    for i in range(1, len(PROMPT_IDS)):
        assert echoed.token_logprobs[i] == pytest.approx(ref[i - 1, PROMPT_IDS[i]].item(), abs=1e-4)
    assert echoed.token_logprobs[len(PROMPT_IDS) :] == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_prompt_logprobs_extension_and_the_bound(http_server, hf_logprobs) -> None:
    import openai

    client, model = openai_client(http_server), model_of(http_server)
    choice = client.completions.create(
        model=model, prompt=PROMPT_IDS, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    ).choices[0]
    prompt = choice.model_extra["prompt_logprobs"]
    ref = hf_logprobs(PROMPT_IDS)
    assert len(prompt) == len(PROMPT_IDS) and prompt[0] is None
    for i in range(1, len(PROMPT_IDS)):
        entry = prompt[i][str(PROMPT_IDS[i])]
        assert entry["logprob"] == pytest.approx(ref[i - 1, PROMPT_IDS[i]].item(), abs=1e-4)
        ranked = sorted((v["rank"], v["logprob"]) for v in prompt[i].values() if v["rank"] is not None)
        assert [r for r, _ in ranked] == [1, 2]
        assert [v for _, v in ranked] == pytest.approx(ref[i - 1].topk(2).values.tolist(), abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="max-logprobs"):
        client.completions.create(model=model, prompt="Hi", max_tokens=1, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="max-logprobs"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, logprobs=True, top_logprobs=21
        )
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, top_logprobs=2
        )


def test_chat_logprobs_equal_the_zmq_ones(http_server) -> None:
    client, model = openai_client(http_server), model_of(http_server)
    messages = [{"role": "user", "content": "Tell me a story"}]
    common = dict(model=model, messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    # How much of a prompt is computed depends on what the prefix cache holds: the first answer
    # computes it whole, a later one only what the cache lacks (after a 1-token answer even
    # the partial last block is reused; after this 6-token one, the full blocks alone), each a
    # different float32 summation order, a few ulps apart. So the cache is brought to the
    # state every answer to this request leaves first: then both faces compute the same
    # numbers, exactly.
    with Client(http_server.address, timeout=60) as zmq_client:
        ask = dict(messages=messages, max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
        zmq_client.generate(**ask)
        ref = zmq_client.generate(**ask).logprobs
    content = client.chat.completions.create(logprobs=True, top_logprobs=2, **common).choices[0].logprobs.content
    assert [c.token for c in content] == ref["tokens"]
    assert [c.logprob for c in content] == ref["token_logprobs"]
    assert [t.logprob for c in content for t in c.top_logprobs] == sum(ref["top_logprobs"], [])
    assert [[t.token for t in c.top_logprobs] for c in content] == ref["top_tokens"]
    assert all(bytes(c.bytes) == c.token.encode() for c in content)
    streamed = [
        c.choices[0].logprobs
        for c in client.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **common)
        if c.choices and c.choices[0].logprobs is not None
    ]
    assert [c.logprob for part in streamed for c in part.content] == ref["token_logprobs"]
    plain = client.chat.completions.create(**common).choices[0]
    assert plain.logprobs is None
