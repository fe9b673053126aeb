"""Parallel sampling (``n``) through bin/serve: over ZeroMQ (conveyor.client, sync and async,
streamed and whole) and over HTTP (the official openai client), on one server. Greedy
sequences are HF greedy; seeded sequence i is what a single request with seed + i samples;
an aborted or disconnected n request frees every block."""

from __future__ import annotations

import asyncio
import time

import msgpack
import openai
import pytest
import zmq

from conveyor.client import AsyncClient, Client
from tests.e2e.conftest import hf_greedy  # noqa: F401  (fixture, registered here)

PROMPT = [5, 17, 33, 2, 41, 9, 12, 28, 3, 50, 7]  # 11 tokens: a partial last block of 8
SEED = 2**64 - 2  # sequence 2's seed wraps around to 0
SEEDS = [SEED, SEED + 1, 0]
SAMPLED = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True}


def wait_until_free(client: Client, bound_s: float) -> float:
    """Seconds until no block is held and nothing is in flight; fails past ``bound_s``."""
    start = time.monotonic()
    while True:
        stats = client.stats()
        if stats["held_blocks"] == 0 and stats["in_flight"] == 0:
            return time.monotonic() - start
        assert time.monotonic() - start < bound_s, f"blocks still held after {bound_s} s: {stats}"
        time.sleep(0.01)


def singles(client: Client) -> list[list[int]]:
    """What single requests with each sequence's seed sample."""
    return [client.generate(token_ids=PROMPT, seed=s, **SAMPLED).token_ids for s in SEEDS]


def test_zmq_greedy_n3_is_hf_greedy_three_times(http_server, hf_greedy) -> None:  # noqa: F811
    expected = hf_greedy(PROMPT, 6)
    with Client(http_server.address, timeout=60) as client:
        result = client.generate(token_ids=PROMPT, n=3, temperature=0, max_tokens=6, ignore_eos=True)
        assert [c.index for c in result.choices] == [0, 1, 2]
        assert all(c.token_ids == expected and c.finish_reason == "length" for c in result.choices), result
        assert len({c.text for c in result.choices}) == 1 and result.text == result.choices[0].text
        assert result.usage.completion_tokens == 18 and result.usage.prompt_tokens == len(PROMPT)
        wait_until_free(client, 1.0)


def test_zmq_seeded_sequences_are_single_requests_with_seed_plus_i(http_server) -> None:
    with Client(http_server.address, timeout=60) as client:
        alone = singles(client)
        assert len({tuple(t) for t in alone}) > 1  # the seeds do draw differently
        whole = client.generate(token_ids=PROMPT, n=3, seed=SEED, **SAMPLED)
        assert [c.token_ids for c in whole.choices] == alone
        # Streamed: each delta names its sequence; per index they add up to that choice.
        got: dict[int, list[int]] = {0: [], 1: [], 2: []}
        texts: dict[int, str] = {0: "", 1: "", 2: ""}
        last = None
        for delta in client.stream(token_ids=PROMPT, n=3, seed=SEED, **SAMPLED):
            got[delta.index] += delta.token_ids
            texts[delta.index] += delta.text
            last = delta
        assert last.result is not None and [c.token_ids for c in last.result.choices] == alone
        assert [got[i] for i in range(3)] == alone
        assert [texts[i] for i in range(3)] == [c.text for c in last.result.choices]
        wait_until_free(client, 1.0)


def test_zmq_async_stop_string_ends_one_sequence_only(http_server) -> None:
    """Each sequence has its own stop strings: one that a sequence's text contains ends that
    sequence there (finish ``stop``), the others run on to ``length``."""
    with Client(http_server.address, timeout=60) as client:
        alone = [client.generate(token_ids=PROMPT, seed=s, **SAMPLED) for s in SEEDS]
    stop = alone[1].text[2:5]
    assert stop and stop not in alone[0].text and stop not in alone[2].text, [a.text for a in alone]

    async def run():
        async with AsyncClient(http_server.address, timeout=60) as client:
            return await client.generate(token_ids=PROMPT, n=3, seed=SEED, stop=[stop], **SAMPLED)

    result = asyncio.run(run())
    reasons = [c.finish_reason for c in result.choices]
    assert reasons == ["length", "stop", "length"], reasons
    assert result.choices[1].text == alone[1].text[: alone[1].text.index(stop)]
    assert result.choices[0].text == alone[0].text and result.choices[2].text == alone[2].text


def test_zmq_abort_and_disconnect_free_every_block(http_server) -> None:
    """An n = 4 request aborted by its id, then one whose connection closes: every sequence
    ends and every block is free within 1 s; counted as one abort each."""
    long = {"temperature": 1.0, "max_tokens": 200, "ignore_eos": True, "n": 4}
    with Client(http_server.address, timeout=60) as client:
        before = client.metrics()["counters"]["request_success"]
        stream = client.stream(token_ids=PROMPT, request_id="many", **long)
        seen = set()
        for delta in stream:
            seen.add(delta.index)
            if len(seen) == 4:
                break
        stream.close()  # leaving the stream early aborts the request
        wait_until_free(client, 1.0)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(http_server.address)
        sock.send(msgpack.packb({"type": "generate", "v": 1, "token_ids": PROMPT, "stream": True, **long}))
        indices = set()
        while len(indices) < 4:
            assert sock.poll(30_000)
            reply = msgpack.unpackb(sock.recv())
            assert reply["type"] == "delta", reply
            indices.add(reply["index"])
        sock.close(linger=0)
        took = wait_until_free(client, 1.0)
        print(f"blocks free {took:.3f} s after the disconnect")
        after = client.metrics()["counters"]["request_success"]
        assert after["abort"] == before["abort"] + 2, (before, after)
        assert after["length"] == before["length"], (before, after)


def ranked_singles(client: Client) -> list[tuple[float, list[int]]]:
    """Single requests with each sequence's seed: (cumulative log-probability, tokens), most
    likely first, the log-probabilities the server reports (logprobs 0: the sampled token's)."""
    outs = [client.generate(token_ids=PROMPT, seed=s, logprobs=0, **SAMPLED) for s in SEEDS]
    scored = [(sum(o.logprobs["token_logprobs"]), o.token_ids) for o in outs]
    assert len({score for score, _ in scored}) == 3  # no tie: the order is the scores'
    return sorted(scored, key=lambda x: -x[0])


def test_zmq_best_of_returns_the_most_likely_sequences(http_server) -> None:
    """best_of 3: the n most likely of the sequences seed, seed + 1, seed + 2, by their
    tokens' summed log-probabilities, most likely first."""
    with Client(http_server.address, timeout=60) as client:
        ranked = ranked_singles(client)
        one = client.generate(token_ids=PROMPT, best_of=3, seed=SEED, **SAMPLED)
        assert [c.token_ids for c in one.choices] == [ranked[0][1]] and one.token_ids == ranked[0][1]
        assert one.usage.completion_tokens == 8 and one.logprobs is None  # (not asked for: not sent)
        two = client.generate(token_ids=PROMPT, n=2, best_of=3, seed=SEED, **SAMPLED)
        assert [c.token_ids for c in two.choices] == [ranked[0][1], ranked[1][1]]
        assert [c.index for c in two.choices] == [0, 1]
        wait_until_free(client, 1.0)


def test_n_over_the_bound_is_refused(http_server) -> None:
    with Client(http_server.address, timeout=60) as client:
        result = client.generate(token_ids=PROMPT, n=65, max_tokens=2)
        assert result.finish_reason == "error" and "'n'" in result.error


# ---------------------------------------------------------------- HTTP, the official client


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_http_completions_n3_whole_and_streamed(http_server, hf_greedy) -> None:  # noqa: F811
    client = openai_client(http_server)
    model = client.models.list().data[0].id
    with Client(http_server.address, timeout=60) as zmq_client:
        alone = [zmq_client.generate(token_ids=PROMPT, seed=s, **SAMPLED) for s in SEEDS]
    extra = {"ignore_eos": True, "return_token_ids": True}
    body = dict(model=model, prompt=PROMPT, n=3, seed=SEED, temperature=1.0, max_tokens=8, extra_body=extra)
    whole = client.completions.create(**body)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.token_ids for c in whole.choices] == [a.token_ids for a in alone]  # type: ignore[attr-defined]
    assert [c.text for c in whole.choices] == [a.text for a in alone]
    assert [c.finish_reason for c in whole.choices] == ["length"] * 3
    assert whole.usage.prompt_tokens == len(PROMPT) and whole.usage.completion_tokens == 24

    texts = ["", "", ""]
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert texts == [a.text for a in alone] and finish == {0: "length", 1: "length", 2: "length"}
    assert usage.prompt_tokens == len(PROMPT) and usage.completion_tokens == 24

    # Two prompts, n = 2: choice index = prompt index * n + sequence index, as OpenAI numbers them.
    greedy = client.completions.create(
        model=model, prompt=[PROMPT, PROMPT[:5]], n=2, temperature=0, max_tokens=4, extra_body=extra
    )
    expected = [hf_greedy(PROMPT, 4)] * 2 + [hf_greedy(PROMPT[:5], 4)] * 2
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
    assert [c.token_ids for c in greedy.choices] == expected  # type: ignore[attr-defined]
    assert greedy.usage.prompt_tokens == len(PROMPT) + 5 and greedy.usage.completion_tokens == 16
    streamed = ["", "", "", ""]
    for chunk in client.completions.create(
        model=model, prompt=[PROMPT, PROMPT[:5]], n=2, temperature=0, max_tokens=4, extra_body=extra, stream=True
    ):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in greedy.choices]


def test_http_best_of(http_server) -> None:
    client = openai_client(http_server)
    model = client.models.list().data[0].id
    with Client(http_server.address, timeout=60) as zmq_client:
        ranked = ranked_singles(zmq_client)
    whole = client.completions.create(
        model=model,
        prompt=PROMPT,
        n=2,
        best_of=3,
        seed=SEED,
        temperature=1.0,
        max_tokens=8,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert [c.token_ids for c in whole.choices] == [ranked[0][1], ranked[1][1]]  # type: ignore[attr-defined]
    assert whole.usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=model, prompt=PROMPT, best_of=3, stream=True)


def test_http_chat_n3_whole_and_streamed(http_server) -> None:
    client = openai_client(http_server)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Say something"}]
    with Client(http_server.address, timeout=60) as zmq_client:
        alone = [zmq_client.generate(messages=messages, seed=s, **SAMPLED).text for s in SEEDS]
    body = dict(
        model=model, messages=messages, n=3, seed=SEED, temperature=1.0, max_tokens=8, extra_body={"ignore_eos": True}
    )
    whole = client.chat.completions.create(**body)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.message.content for c in whole.choices] == alone
    assert whole.usage.completion_tokens == 24
    texts = ["", "", ""]
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert texts == alone and finish == {0: "length", 1: "length", 2: "length"}
    with Client(http_server.address, timeout=60) as zmq_client:
        wait_until_free(zmq_client, 1.0)


# ---------------------------------------------------------------- log-probabilities per sequence

LOGGED = {**SAMPLED, "logprobs": 2, "prompt_logprobs": 1}


def assert_same_columns(got: dict, expected: dict) -> None:
    """The same rows (start, tokens, top ids) with values equal to float32 rounding (sequences
    run in batches of other shapes than a single request, which moves the last bits on CPU)."""
    for key in ("start", "tokens", "top_token_ids", "top_tokens"):
        assert got[key] == expected[key], key
    assert got["token_logprobs"] == pytest.approx(expected["token_logprobs"], abs=1e-5)
    assert sum(got["top_logprobs"], []) == pytest.approx(sum(expected["top_logprobs"], []), abs=1e-5)


def joined(parts: list[dict]) -> dict:
    """Consecutive deltas' columns as one."""
    out = {"start": parts[0]["start"]}
    for key in ("tokens", "token_logprobs", "top_token_ids", "top_tokens", "top_logprobs"):
        out[key] = sum((p[key] for p in parts), [])
    return out


def test_zmq_sequence_logprobs_are_single_requests_with_seed_plus_i(http_server) -> None:
    """n = 3 with logprobs: choice i's columns are a single request's with seed + i, in the
    final and added up from its deltas; the prompt's come once per request."""
    with Client(http_server.address, timeout=60) as client:
        alone = [client.generate(token_ids=PROMPT, seed=s, **LOGGED) for s in SEEDS]
        whole = client.generate(token_ids=PROMPT, n=3, seed=SEED, **LOGGED)
        deltas = list(client.stream(token_ids=PROMPT, n=3, seed=SEED, **LOGGED))
        best = client.generate(token_ids=PROMPT, n=2, best_of=3, seed=SEED, **LOGGED)
        wait_until_free(client, 1.0)
    for choice, single in zip(whole.choices, alone, strict=True):
        assert choice.token_ids == single.token_ids and len(choice.logprobs["token_logprobs"]) == 8
        assert_same_columns(choice.logprobs, single.logprobs)
    assert whole.logprobs == whole.choices[0].logprobs  # the top level's: choice 0's, as its text
    assert_same_columns(whole.prompt_logprobs, alone[0].prompt_logprobs)
    final = deltas[-1].result
    assert [c.logprobs for c in final.choices] == [c.logprobs for c in whole.choices]
    for i in range(3):
        assert joined([d.logprobs for d in deltas if d.index == i and d.logprobs]) == final.choices[i].logprobs
    prompt_parts = [d.prompt_logprobs for d in deltas if d.prompt_logprobs]
    assert len(prompt_parts) == 1 and prompt_parts[0] == final.prompt_logprobs  # once, not per sequence
    # best_of with logprobs: the kept choices carry theirs, most likely first.
    by_tokens = {tuple(a.token_ids): a for a in alone}
    scores = [sum(c.logprobs["token_logprobs"]) for c in best.choices]
    assert scores == sorted(scores, reverse=True)
    for choice in best.choices:
        assert_same_columns(choice.logprobs, by_tokens[tuple(choice.token_ids)].logprobs)


def test_http_sequence_logprobs_completions_and_chat(http_server) -> None:
    """``choices[i].logprobs`` of an n = 3 completion (whole and streamed) and chat are
    choice i's own: a single request's with seed + i."""
    client = openai_client(http_server)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Say something"}]
    with Client(http_server.address, timeout=60) as zmq_client:
        alone = [zmq_client.generate(token_ids=PROMPT, seed=s, logprobs=2, **SAMPLED).logprobs for s in SEEDS]
        chat_alone = [zmq_client.generate(messages=messages, seed=s, logprobs=2, **SAMPLED).logprobs for s in SEEDS]
    body = dict(
        model=model,
        prompt=PROMPT,
        n=3,
        seed=SEED,
        temperature=1.0,
        max_tokens=8,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**body)
    for choice, single in zip(whole.choices, alone, strict=True):
        assert choice.logprobs.tokens == single["tokens"]
        assert choice.logprobs.token_logprobs == pytest.approx(single["token_logprobs"], abs=1e-5)
        assert choice.logprobs.text_offset == [sum(len(t) for t in single["tokens"][:j]) for j in range(8)]
    streamed: dict[int, list] = {0: [], 1: [], 2: []}
    offsets: dict[int, list] = {0: [], 1: [], 2: []}
    for chunk in client.completions.create(**body, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed[c.index] += c.logprobs.token_logprobs
                offsets[c.index] += c.logprobs.text_offset
    assert [streamed[i] for i in range(3)] == [c.logprobs.token_logprobs for c in whole.choices]
    assert [offsets[i] for i in range(3)] == [c.logprobs.text_offset for c in whole.choices]
    chat = client.chat.completions.create(
        model=model,
        messages=messages,
        n=3,
        seed=SEED,
        temperature=1.0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    for choice, single in zip(chat.choices, chat_alone, strict=True):
        assert [c.token for c in choice.logprobs.content] == single["tokens"]
        assert [c.logprob for c in choice.logprobs.content] == pytest.approx(single["token_logprobs"], abs=1e-5)
    # prompt_logprobs: each completion choice of the input has the input's; a chat answer them once, at the top
    asked = dict(temperature=1.0, max_tokens=2, n=2, extra_body={"prompt_logprobs": 1})
    completion = client.completions.create(model=model, prompt=PROMPT, **asked)
    prompts = [c.model_extra["prompt_logprobs"] for c in completion.choices]
    assert len(prompts[0]) == len(PROMPT) and prompts[0][0] is None and prompts[1] == prompts[0]
    answer = client.chat.completions.create(model=model, messages=messages, **asked)
    assert answer.model_extra["prompt_logprobs"][0] is None and len(answer.model_extra["prompt_logprobs"]) > 1
    assert all("prompt_logprobs" not in (c.model_extra or {}) for c in answer.choices)


def test_http_echo_with_logprobs_leads_every_choice_with_the_prompt(http_server) -> None:
    """echo + logprobs + n = 2: each choice's log-probabilities start with the prompt's (the
    first with null), whole and in each choice's streamed chunks, although the server sends
    the prompt's columns once per request."""
    client = openai_client(http_server)
    model = client.models.list().data[0].id
    body = dict(
        model=model,
        prompt=PROMPT,
        n=2,
        seed=SEED,
        temperature=1.0,
        max_tokens=4,
        logprobs=1,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**body)
    streamed: dict[int, list] = {0: [], 1: []}
    for chunk in client.completions.create(**body, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed[c.index] += c.logprobs.token_logprobs
    for choice in whole.choices:
        values = choice.logprobs.token_logprobs
        assert len(values) == len(PROMPT) + 4 and values[0] is None and None not in values[1:]
        assert values[: len(PROMPT)] == whole.choices[0].logprobs.token_logprobs[: len(PROMPT)]
        assert streamed[choice.index] == values
