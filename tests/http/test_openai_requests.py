"""The HTTP face's pure parts: OpenAI bodies -> generate fields, the SSE chunks, the status
of each failure. No server, no torch (this file runs in the no-torch venv too)."""

from __future__ import annotations

import json

import pytest

from conveyor.client import CompletionResult, Usage
from conveyor.http import errors
from conveyor.http.openai_requests import CHAT, COMPLETION, MAX_PROMPTS, parse_request
from conveyor.http.openai_responses import ChunkEncoder, chunk_object, completion_body

MODEL = "tiny"


def parse(kind: str = COMPLETION, **body):
    body.setdefault("model", MODEL)
    if kind == COMPLETION:
        body.setdefault("prompt", "hi")
    else:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_request(kind, body, MODEL)


def refused(status: int, param: str | None, kind: str = COMPLETION, **body) -> errors.ApiError:
    with pytest.raises(errors.ApiError) as info:
        parse(kind, **body)
    assert (info.value.status, info.value.param) == (status, param), info.value.message
    return info.value


def test_fields_map_onto_the_protocol() -> None:
    job = parse(
        prompt="hello", max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=["\n"], top_k=4, min_p=0.1,
        priority=2, ignore_eos=True, stop_token_ids=[5], user="me", presence_penalty=0.5, frequency_penalty=-1, n=1,
        logprobs=None, repetition_penalty=1.2, min_tokens=2, logit_bias={"5": 1, "7": -2.5},
    )  # fmt: skip
    assert job.inputs == [{"prompt": "hello"}] and not job.stream
    assert job.options == {
        "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["\n"], "top_k": 4, "min_p": 0.1,
        "priority": 2, "ignore_eos": True, "stop_token_ids": [5], "presence_penalty": 0.5, "frequency_penalty": -1,
        "repetition_penalty": 1.2, "min_tokens": 2, "logit_bias": {"5": 1, "7": -2.5}, "n": 1,
    }  # fmt: skip
    # logit_bias travels as a map of numbers, bounded in size (the frontend judges the ids and values)
    refused(400, "logit_bias", logit_bias=[1])
    refused(400, "logit_bias", logit_bias={"5": "x"})
    refused(400, "logit_bias", logit_bias={"5": 2**70})
    refused(400, "logit_bias", logit_bias={str(i): 1 for i in range(1025)})
    assert parse(max_completion_tokens=9, max_tokens=3).options["max_tokens"] == 9
    stream = parse(CHAT, stream=True, stream_options={"include_usage": True})
    assert (
        stream.stream and stream.include_usage and stream.inputs[0]["messages"] == [{"role": "user", "content": "hi"}]
    )


def test_prompt_shapes() -> None:
    assert parse(prompt=["a", "b"]).inputs == [{"prompt": "a"}, {"prompt": "b"}]
    assert parse(prompt=[1, 2, 3]).inputs == [{"token_ids": [1, 2, 3]}]
    assert parse(prompt=[[1, 2], [3]]).inputs == [{"token_ids": [1, 2]}, {"token_ids": [3]}]
    for bad in ([], [1, "a"], [[1], []], [[1.5]], {"a": 1}, 5, [True]):
        refused(400, "prompt", prompt=bad)
    refused(400, "prompt", prompt=["a"] * (MAX_PROMPTS + 1))
    refused(400, "prompt", prompt=[2**70])  # msgpack stops at 64 bits


def test_chat_content_parts_are_joined_and_other_content_refused() -> None:
    job = parse(
        CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    )
    assert job.inputs[0]["messages"] == [{"role": "user", "content": "ab"}]
    for bad in (
        [],
        "hi",
        [{"content": "x"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": [{"type": "image_url"}]}],
    ):
        refused(400, "messages", CHAT, messages=bad)


def test_what_conveyor_cannot_do_is_refused_by_name() -> None:
    assert parse(n=3).n == 3 and parse(n=3).options["n"] == 3  # forwarded: the frontend bounds it
    refused(400, "n", n=[2])
    parse(CHAT, logprobs=False)
    refused(400, "echo", CHAT, echo=True)
    assert parse(echo=True).echo
    for name, value in (
        ("use_beam_search", True),
        ("bad_words", ["x"]),
        ("add_special_tokens", False),
        ("allowed_token_ids", [1]),
        ("suffix", "end"),
    ):
        assert name in refused(400, name, **{name: value}).message
    refused(400, "add_special_tokens", CHAT, add_special_tokens=True)  # chat's do-nothing value is false
    refused(400, "prompt", CHAT, prompt="x")  # a completions field on the chat endpoint: always refused
    refused(400, "add_generation_prompt", add_generation_prompt=True)


def test_unknown_fields_are_ignored_and_reported_unless_strict() -> None:
    """A field no schema knows is dropped and named (vLLM's behaviour), or with
    --strict-fields a 400 naming it; it never reaches the protocol options."""
    job = parse(foo=1, zeta={"x": 1}, user="u")
    assert job.unknown == ("foo", "zeta") and job.ignored == ("foo", "user", "zeta")
    assert "foo" not in job.options and "zeta" not in job.options
    with pytest.raises(errors.ApiError) as info:
        parse_request(COMPLETION, {"model": MODEL, "prompt": "hi", "foo": 1}, MODEL, strict=True)
    assert (info.value.status, info.value.param) == (400, "foo") and "--strict-fields" in info.value.message


def test_structured_output_fields_become_one_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": schema, "strict": True},
                }
            },
            {"type": "json_schema", "schema": schema, "strict": True},
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
            {"type": "json_schema", "schema": schema, "strict": False},
        ),
        ({"response_format": {"type": "json_object"}}, {"type": "json_object"}),
        ({"guided_json": schema}, {"type": "json_schema", "schema": schema, "strict": False}),
        ({"guided_regex": "a+"}, {"type": "regex", "pattern": "a+"}),
        ({"guided_choice": ["x", "y"]}, {"type": "choice", "choices": ["x", "y"]}),
        ({"guided_grammar": "start: 'a'"}, {"type": "grammar", "grammar": "start: 'a'"}),
        ({"structured_outputs": {"regex": "b"}}, {"type": "regex", "pattern": "b"}),
        ({"structured_outputs": {"json_object": True}}, {"type": "json_object"}),
    ]
    for body, constraint in cases:
        assert parse(CHAT, **body).options["constraint"] == constraint, body
    assert "constraint" not in parse(CHAT, response_format={"type": "text"}).options
    refused(400, "guided_regex", CHAT, guided_json=schema, guided_regex="a")
    refused(400, "response_format", CHAT, response_format={"type": "yaml"})
    refused(400, "structured_outputs", CHAT, structured_outputs={"regex": "a", "choice": ["b"]})
    tools = [{"type": "function", "function": {"name": "f"}}]
    job = parse(CHAT, tools=tools, tool_choice="required")
    assert (job.options["tools"], job.options["tool_choice"], job.forced_tool_choice, job.tools) == (
        tools,
        "required",
        "required",
        True,
    )
    job = parse(CHAT, tools=tools, tool_choice="none")
    assert (job.forced_tool_choice, job.tools) == (None, False)


def test_every_field_of_the_vllm_schemas_is_known_and_do_nothing_values_pass() -> None:
    """Each field of OpenAI's and vLLM's request schemas (the names as of vLLM 0.10) is taken
    with the value a client sends when it asks for nothing special; the no-effect ones are
    listed as ignored, and chat without max_tokens runs to the context limit."""
    both = dict(
        n=1, best_of=1, logprobs=None, top_logprobs=0, presence_penalty=0.0, frequency_penalty=0, logit_bias={},
        user="u",
        metadata={"a": "b"}, store=False, service_tier="auto", use_beam_search=False, length_penalty=1.0,
        repetition_penalty=1.0, min_tokens=0, bad_words=[], allowed_token_ids=None, prompt_logprobs=None,
        spaces_between_special_tokens=True, request_id="abc", cache_salt="s", kv_transfer_params=None,
        vllm_xargs={"k": 1},
        return_tokens_as_token_ids=False, guided_decoding_backend="auto", guided_json=None, structured_outputs=None,
        logits_processors=None, response_format={"type": "text"}, skip_special_tokens=True,
        include_stop_str_in_output=False,
        truncate_prompt_tokens=None, return_token_ids=False,
    )  # fmt: skip
    job = parse(echo=False, suffix="", add_special_tokens=True, prompt_embeds=None, **both)
    assert set(job.ignored) == {
        "user",
        "metadata",
        "store",
        "service_tier",
        "spaces_between_special_tokens",
        "request_id",
        "cache_salt",
        "vllm_xargs",
        "return_tokens_as_token_ids",
        "guided_decoding_backend",
    }
    neutral = {
        "presence_penalty": 0.0,
        "frequency_penalty": 0,
        "logit_bias": {},
        "repetition_penalty": 1.0,
        "min_tokens": 0,
    }
    assert job.options == {
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
        "n": 1,
        "best_of": 1,
        **neutral,
    }
    chat = parse(
        CHAT, tools=[], tool_choice="none", parallel_tool_calls=True, add_generation_prompt=True,
        continue_final_message=False,
        chat_template_kwargs={"enable_thinking": False}, documents=None, chat_template=None, mm_processor_kwargs=None,
        include_reasoning=True, add_special_tokens=False, echo=False, max_completion_tokens=None, **both,
    )  # fmt: skip
    assert chat.options["fill_context"] and "max_tokens" not in chat.options
    assert chat.options["chat_template_kwargs"] == {"enable_thinking": False}
    assert "parallel_tool_calls" in chat.ignored and "include_reasoning" in chat.ignored
    assert "fill_context" not in parse(CHAT, max_tokens=5).options and "fill_context" not in parse().options
    stream = parse(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert stream.include_usage and stream.continuous_usage
    assert not parse(
        stream=True, stream_options={"continuous_usage_stats": True}
    ).continuous_usage  # only with include_usage
    refused(400, "chat_template_kwargs", CHAT, chat_template_kwargs={"x": "a" * 40000})
    refused(400, "add_generation_prompt", COMPLETION, add_generation_prompt=True)  # a chat field on completions


def test_model_stream_and_wrong_types() -> None:
    assert refused(404, "model", model="gpt-4").code == "model_not_found"
    refused(400, "model", model=None)
    refused(400, "model", model=3)
    refused(400, "stream", stream="yes")
    refused(400, "stream_options", stream_options={"include_usage": True})  # without stream
    refused(400, "stream_options", stream=True, stream_options={"include_usage": "yes"})
    refused(400, "stop", stop=[1])
    refused(400, "temperature", temperature=[1])
    refused(400, "max_tokens", max_tokens={"a": 1})
    with pytest.raises(errors.ApiError, match="JSON object"):
        parse_request(COMPLETION, [1], MODEL)
    # values of protocol fields travel as they are: the frontend judges them
    assert parse(temperature="hot").options["temperature"] == "hot"


@pytest.mark.parametrize(
    "message, status, param",
    [
        ("overloaded: 3 requests are waiting (max_waiting 1); retry later", 429, None),
        ("timeout: not scheduled within max_queue_time (1 s)", 503, None),
        ("scheduler process died (exit code -9)", 503, None),
        ("server shutting down", 503, None),
        ("worker sampled no token for this request (slot 1, step 2)", 500, None),
        ("'temperature' must be a number >= 0, got 'hot'", 400, "temperature"),
        ("'token_ids' must contain only integers", 400, "prompt"),
        ("max_tokens=9 with a 4-token prompt exceeds the model length 8; at most 4 new tokens fit", 400, "max_tokens"),
        ("prompt has 300 tokens; the model's limit is 256 including output", 400, "prompt"),
        ("token id 99999 is outside the vocabulary [0, 100)", 400, "prompt"),
        ("stop token id 99999 is outside the vocabulary [0, 100)", 400, "stop_token_ids"),
    ],
)
def test_error_finals_get_their_status(message: str, status: int, param: str | None) -> None:
    error = errors.from_final_error(message)
    assert (error.status, error.param) == (status, param)
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"] == message


def result(text: str, prompt: int, completion: int, cached: int = 0) -> CompletionResult:
    return CompletionResult("r", text, list(range(completion)), "length", Usage(prompt, completion, cached))


@pytest.mark.parametrize("kind", [COMPLETION, CHAT])
@pytest.mark.parametrize("include_usage", [False, True])
def test_the_fast_chunk_is_the_chunk_object(kind: str, include_usage: bool) -> None:
    enc = ChunkEncoder(kind, "id-1", 123, 'mo"del', include_usage)
    for index, text in ((0, "plain"), (3, 'quote " and \\ and \n and ☃ and \x00')):
        raw = enc.text(index, text)
        assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
        assert json.loads(raw[6:]) == chunk_object(kind, "id-1", 123, 'mo"del', index, text, None, include_usage)
    finish = json.loads(enc.finish(1, "stop")[6:])
    assert finish["choices"][0]["finish_reason"] == "stop" and ("usage" in finish) == include_usage
    usage = json.loads(enc.usage([result("a", 3, 2, 1), result("b", 4, 5)])[6:])
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 7, "completion_tokens": 7, "total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 1},
    }  # fmt: skip
    if kind == CHAT:
        assert json.loads(enc.role(0)[6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_unstreamed_bodies() -> None:
    body = completion_body(CHAT, "id", 1, MODEL, [result("hello", 3, 2)])
    assert body["object"] == "chat.completion" and body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "hello",
    }
    assert body["usage"]["total_tokens"] == 5
    body = completion_body(COMPLETION, "id", 1, MODEL, [result("a", 1, 1), result("b", 1, 1)])
    assert [c["text"] for c in body["choices"]] == ["a", "b"] and [c["index"] for c in body["choices"]] == [0, 1]


def test_logprob_fields_become_the_protocol_k() -> None:
    """Completions' ``logprobs`` is k; chat's is a flag with ``top_logprobs`` its k (which
    needs the flag); echo asks the prompt's too; prompt_logprobs is forwarded."""
    job = parse(logprobs=2)
    assert job.logprobs == 2 and job.options["logprobs"] == 2 and "prompt_logprobs" not in job.options
    assert parse(logprobs=0).options["logprobs"] == 0  # 0: the sampled token's alone
    assert parse(logprobs=3, echo=True).options["prompt_logprobs"] == 3
    assert parse(prompt_logprobs=1).options["prompt_logprobs"] == 1 and parse(prompt_logprobs=1).prompt_logprobs
    assert parse().logprobs is None and "logprobs" not in parse().options
    chat = parse(CHAT, logprobs=True, top_logprobs=3)
    assert chat.logprobs == 3 and chat.options["logprobs"] == 3
    assert parse(CHAT, logprobs=True).options["logprobs"] == 0
    assert parse(CHAT, logprobs=False, top_logprobs=None).logprobs is None
    refused(400, "logprobs", logprobs=-1)
    refused(400, "logprobs", logprobs=True)
    refused(400, "logprobs", CHAT, logprobs=2)
    refused(400, "top_logprobs", CHAT, top_logprobs=2)  # without logprobs: true
    refused(400, "top_logprobs", top_logprobs=2)  # a chat field
