"""The official ``openai`` client against bin/serve --http-port: sync and async, streamed and
not, completions and chat. Greedy answers are the ones conveyor.client gets over ZeroMQ for
the same request."""

from __future__ import annotations

import asyncio

import openai
import pytest

from conveyor.client import Client

GREEDY = {"temperature": 0, "max_tokens": 8}
EXTRA = {"ignore_eos": True}  # Conveyor's own fields travel in extra_body


def sync_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def model_of(server) -> str:
    return sync_client(server).models.list().data[0].id


def test_models_lists_the_served_name(http_server, tiny_checkpoint) -> None:
    models = sync_client(http_server).models.list().data
    assert [m.id for m in models] == [tiny_checkpoint.name]


def test_sync_completion_streamed_and_not_equal_the_zmq_client(http_server) -> None:
    client, model = sync_client(http_server), model_of(http_server)
    with Client(http_server.address, timeout=60) as zmq_client:
        reference = zmq_client.generate("The quick brown fox", ignore_eos=True, **GREEDY)
    whole = client.completions.create(model=model, prompt="The quick brown fox", extra_body=EXTRA, **GREEDY)
    assert whole.choices[0].text == reference.text and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (reference.usage.prompt_tokens, 8)
    assert whole.usage.total_tokens == reference.usage.prompt_tokens + 8
    chunks = list(
        client.completions.create(
            model=model,
            prompt="The quick brown fox",
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXTRA,
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_sync_chat_streamed_and_not_equal_the_zmq_client(http_server) -> None:
    client, model = sync_client(http_server), model_of(http_server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    with Client(http_server.address, timeout=60) as zmq_client:
        reference = zmq_client.generate(messages=messages, ignore_eos=True, **GREEDY)
    whole = client.chat.completions.create(model=model, messages=messages, extra_body=EXTRA, **GREEDY)
    assert whole.choices[0].message.content == reference.text and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == reference.usage.prompt_tokens
    stream = client.chat.completions.create(
        model=model, messages=messages, stream=True, stream_options={"include_usage": True},
        max_completion_tokens=8, temperature=0, extra_body=EXTRA,
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference.text
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == reference.usage.prompt_tokens


def test_async_client_many_at_once(http_server) -> None:
    prompts = [f"Request number {i} says" for i in range(8)]
    with Client(http_server.address, timeout=60) as zmq_client:
        references = [zmq_client.generate(p, ignore_eos=True, **GREEDY).text for p in prompts]

    async def run():
        client = async_client(http_server)
        model = (await client.models.list()).data[0].id

        async def streamed(prompt: str) -> str:
            stream = await client.completions.create(
                model=model, prompt=prompt, stream=True, extra_body=EXTRA, **GREEDY
            )
            return "".join([c.choices[0].text async for c in stream])

        async def whole(prompt: str) -> str:
            return (
                (await client.completions.create(model=model, prompt=prompt, extra_body=EXTRA, **GREEDY))
                .choices[0]
                .text
            )

        async def chat(prompt: str) -> str:
            reply = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], **GREEDY
            )
            return reply.choices[0].message.content

        async def chat_streamed(prompt: str) -> str:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], stream=True, **GREEDY
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream])

        texts = await asyncio.gather(*(streamed(p) if i % 2 else whole(p) for i, p in enumerate(prompts)))
        chats = await asyncio.gather(chat(prompts[0]), chat_streamed(prompts[0]))
        await client.close()
        return texts, chats

    texts, chats = asyncio.run(run())
    assert texts == references
    assert chats[0] == chats[1]


def test_prompt_as_token_ids_and_several_prompts(http_server) -> None:
    client, model = sync_client(http_server), model_of(http_server)
    with Client(http_server.address, timeout=60) as zmq_client:
        by_ids = zmq_client.generate(token_ids=[11, 12, 13], ignore_eos=True, **GREEDY).text
        by_text = zmq_client.generate("abc", ignore_eos=True, **GREEDY).text
    assert (
        client.completions.create(model=model, prompt=[11, 12, 13], extra_body=EXTRA, **GREEDY).choices[0].text
        == by_ids
    )
    both = client.completions.create(model=model, prompt=[[11, 12, 13], [11, 12, 13]], extra_body=EXTRA, **GREEDY)
    assert [c.text for c in both.choices] == [by_ids, by_ids] and both.usage.completion_tokens == 16
    stream = client.completions.create(
        model=model, prompt=["abc", "abc", "abc"], stream=True, extra_body=EXTRA, **GREEDY
    )
    texts = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [by_text] * 3


def test_seed_and_stop(http_server) -> None:
    client, model = sync_client(http_server), model_of(http_server)
    sampled = [
        client.completions.create(model=model, prompt="abc", max_tokens=8, temperature=1.0, seed=1234, extra_body=EXTRA)
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]
    # A stop string from the middle of the unconstrained text (24 tokens: always long enough).
    long = {**GREEDY, "max_tokens": 24}
    base = client.completions.create(model=model, prompt="abc", extra_body=EXTRA, **long).choices[0].text
    assert len(base) >= 8, base
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    expected = base[: base.index(stop)]
    assert expected, (base, stop)
    cut = client.completions.create(model=model, prompt="abc", stop=stop, extra_body=EXTRA, **long).choices[0]
    assert cut.text == expected and cut.finish_reason == "stop"


def test_client_errors_are_the_openai_exceptions(http_server) -> None:
    client, model = sync_client(http_server), model_of(http_server)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="not-this-one", prompt="hi")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="'best_of' > n is not supported with streaming"):
        client.completions.create(model=model, prompt="hi", best_of=2, stream=True)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", top_p=5)
    assert info.value.body["param"] == "top_p"


def test_sampling_controls_match_hf(http_server, hf_controlled, tiny_checkpoint) -> None:
    """OpenAI's own presence / frequency penalties and logit_bias (string keys, as JSON has
    them), vLLM's repetition_penalty and min_tokens in extra_body: the greedy tokens are
    transformers' under the matching processors, on both endpoints."""
    from conveyor.frontend.tokenizer import Tokenizer

    client, model = sync_client(http_server), model_of(http_server)
    prompt = [5 + (3 * j) % 60 for j in range(10)]
    ids = {"return_token_ids": True}
    got = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, presence_penalty=-2.0, frequency_penalty=0.5,
        logit_bias={"9": 4.0, "30": 3.5}, extra_body={**EXTRA, **ids, "repetition_penalty": 1.3},
    )  # fmt: skip
    expected = hf_controlled(
        prompt, 12, presence_penalty=-2.0, frequency_penalty=0.5, logit_bias={9: 4.0, 30: 3.5}, repetition_penalty=1.3
    )
    assert got.choices[0].model_extra["token_ids"] == expected
    # min_tokens holds back a stop token a +100 bias favours, then the request stops on it.
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0, logit_bias={"40": 100},
        extra_body={**ids, "min_tokens": 3, "stop_token_ids": [40]},
    )  # fmt: skip
    eos = Tokenizer.from_dir(tiny_checkpoint).eos_token_id
    prompt_ids = chat.model_extra["prompt_token_ids"]
    assert chat.choices[0].model_extra["token_ids"] == hf_controlled(
        prompt_ids, 12, stop=(40, eos), logit_bias={40: 100.0}, min_tokens=3
    )
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == 4
    for field, value in (
        ("presence_penalty", 3),
        ("logit_bias", {"9": 101}),
        ("logit_bias", {"99999": 1}),
        ("logit_bias", [1]),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt="hi", **{field: value})
        assert info.value.body["param"] == field, info.value.body
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", max_tokens=4, extra_body={"min_tokens": 5})
    assert info.value.body["param"] == "min_tokens", info.value.body
