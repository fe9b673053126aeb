"""Validation of client maps: every bad field gets an error that names it."""

from __future__ import annotations

import msgpack
import pytest

from conveyor.protocol import limits, validation, wire
from conveyor.protocol import requests as client_requests


def gen(**fields):
    return {"type": "generate", "v": 1, "request_id": "r1", "prompt": "hi", **fields}


def test_valid_generate_parses_all_fields() -> None:
    req = client_requests.parse_client_message(
        gen(
            max_tokens=5,
            temperature=0,
            top_p=0.5,
            top_k=3,
            min_p=0.1,
            seed=7,
            stop=["x"],
            stop_token_ids=[2],
            ignore_eos=True,
            stream=True,
            speculate=False,
        )
    )
    assert isinstance(req, client_requests.GenerateRequest)
    assert req.request_id == "r1" and req.prompt == "hi" and req.stream and req.stop == ["x"]
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (5, 0.0, 0.5, 3, 0.1, 7)
    assert s.stop_token_ids == [2] and s.ignore_eos and s.greedy and not s.speculate
    assert client_requests.parse_client_message(gen()).sampling.speculate  # (speculation is opt-out)


def test_request_id_is_assigned_when_absent() -> None:
    msg = gen()
    del msg["request_id"]
    a, b = client_requests.parse_client_message(msg), client_requests.parse_client_message(msg)
    assert a.request_id and a.request_id != b.request_id


def test_stop_accepts_single_string() -> None:
    assert client_requests.parse_client_message(gen(stop="END")).stop == ["END"]


def test_n_is_bounded_and_reaches_the_sampling_params() -> None:
    assert client_requests.parse_client_message(gen()).sampling.n == 1
    assert client_requests.parse_client_message(gen(n=limits.MAX_N)).sampling.n == limits.MAX_N
    # best_of > n: best_of sequences at the scheduler, with their tokens' log-probabilities
    best = client_requests.parse_client_message(gen(n=2, best_of=5))
    assert (best.sampling.n, best.sampling.logprobs, best.keep_best, best.ranking_logprobs) == (5, 0, 2, True)
    # ... the client's k when it asked for them (then sent, not only ranked by)
    asked = client_requests.parse_client_message(gen(n=2, best_of=5, logprobs=3, prompt_logprobs=1))
    assert (asked.sampling.logprobs, asked.sampling.prompt_logprobs, asked.ranking_logprobs) == (3, 1, False)
    logged = client_requests.parse_client_message(gen(n=2, logprobs=0, prompt_logprobs=2))  # n > 1: per sequence
    assert (logged.sampling.n, logged.sampling.logprobs, logged.sampling.prompt_logprobs) == (2, 0, 2)
    constrained = client_requests.parse_client_message(gen(n=2, constraint={"type": "regex", "pattern": "a+"}))
    assert constrained.sampling.n == 2 and constrained.constraint is not None  # each sequence bound on its own
    same = client_requests.parse_client_message(gen(n=2, best_of=2, stream=True))  # best_of = n: plain n
    assert (same.sampling.n, same.sampling.logprobs, same.keep_best) == (2, None, None)


def test_priority_is_an_optional_integer() -> None:
    assert client_requests.parse_client_message(gen()).priority == 0
    assert client_requests.parse_client_message(gen(priority=-3)).priority == -3
    for bad in ("high", 1.5, True, 2**40):
        with pytest.raises(wire.ProtocolError, match="'priority'"):
            client_requests.parse_client_message(gen(priority=bad))


@pytest.mark.parametrize(
    "msg, needle",
    [
        ({"v": 1}, "missing field 'type'"),
        ({"type": "bogus"}, "unknown message type"),
        (gen(v=2), "version"),
        (gen(prompt=None), "exactly one of"),
        ({**gen(), "token_ids": [1]}, "exactly one of"),
        (gen(prompt=""), "'prompt' is empty"),
        (gen(prompt=5), "'prompt' must be a string"),
        ({**gen(prompt=None), "messages": []}, "'messages'"),
        ({**gen(prompt=None), "messages": [{"role": "user"}]}, "'messages'\\[0\\]"),
        ({**gen(prompt=None), "token_ids": [1, "a"]}, "'token_ids'"),
        ({**gen(prompt=None), "token_ids": [1, True]}, "'token_ids'"),
        (gen(max_tokens=0), "'max_tokens'"),
        (gen(max_tokens=1.5), "'max_tokens'"),
        (gen(temperature=-0.1), "'temperature'"),
        (gen(temperature=float("nan")), "'temperature'"),
        (gen(top_p=0), "'top_p'"),
        (gen(top_p=1.5), "'top_p'"),
        (gen(top_k=-1), "'top_k'"),
        (gen(min_p=2), "'min_p'"),
        (gen(seed=-(2**63) - 1), "'seed'"),
        (gen(seed=2**64), "'seed'"),
        (gen(seed="x"), "'seed'"),
        (gen(stop=[""]), "'stop'"),
        (gen(stop=[1]), "'stop'"),
        (gen(stop_token_ids=[-1]), "'stop_token_ids'"),
        (gen(ignore_eos="yes"), "'ignore_eos'"),
        (gen(speculate=1), "'speculate'"),
        (gen(n=0), "'n'"),
        (gen(n=65), "'n'"),
        (gen(n=2.0), "'n'"),
        (gen(n=True), "'n'"),
        (gen(n=2, best_of=1), "'best_of' must be an integer in \\[n, 64\\]"),
        (gen(best_of=65), "'best_of'"),
        (gen(best_of=2, stream=True), "'best_of' > n is not supported with streaming"),
        (gen(stream=1), "'stream'"),
        (gen(bogus=1), "unknown field"),
        (gen(request_id=""), "'request_id'"),
        ({"type": "abort"}, "request_id"),
    ],
)
def test_bad_fields_are_named(msg, needle) -> None:
    with pytest.raises(wire.ProtocolError, match=needle):
        client_requests.parse_client_message(msg)


def test_error_keeps_request_id_when_readable() -> None:
    with pytest.raises(wire.ProtocolError) as info:
        client_requests.parse_client_message(gen(top_p=3))
    assert info.value.request_id == "r1"


@pytest.mark.parametrize("data, needle", [(b"\xc1", "malformed"), (msgpack.packb([1, 2]), "must be a map")])
def test_unpack_rejects_non_maps(data, needle) -> None:
    with pytest.raises(wire.ProtocolError, match=needle):
        wire.unpack_map(data)


def test_unpack_rejects_oversized() -> None:
    with pytest.raises(wire.ProtocolError, match="exceeds"):
        wire.unpack_map(b"\x00" * (limits.MAX_CLIENT_MESSAGE_BYTES + 1))


def test_profile_defaults_and_fields() -> None:
    cmd = client_requests.parse_client_message({"type": "profile", "v": 1})
    assert isinstance(cmd, client_requests.ProfileCommand)
    assert (cmd.window_s, cmd.trace, cmd.series) == (limits.DEFAULT_PROFILE_WINDOW_S, False, [])
    cmd = client_requests.parse_client_message(
        {"type": "profile", "window_s": 5, "trace": True, "series": ["batch_seqs"]}
    )
    assert (cmd.window_s, cmd.trace, cmd.series) == (5.0, True, ["batch_seqs"])


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"window_s": 0}, "window_s"),
        ({"window_s": 1e9}, "window_s"),
        ({"window_s": True}, "window_s"),
        ({"trace": 1}, "trace"),
        ({"series": "batch_seqs"}, "series"),
        ({"series": [1]}, "series"),
        ({"trace_path": "x"}, "unknown field"),
    ],
)
def test_profile_bad_fields_are_named(fields, needle) -> None:
    with pytest.raises(wire.ProtocolError, match=needle):
        client_requests.parse_client_message({"type": "profile", "v": 1, **fields})


def test_stats_leaves_the_iteration_log_out_unless_asked() -> None:
    assert client_requests.parse_client_message({"type": "stats", "v": 1}) == client_requests.StatsCommand(
        iterations=False
    )
    assert client_requests.parse_client_message(
        {"type": "stats", "v": 1, "iterations": True}
    ) == client_requests.StatsCommand(iterations=True)
    with pytest.raises(wire.ProtocolError, match="'iterations'"):
        client_requests.parse_client_message({"type": "stats", "v": 1, "iterations": 1})


VOCAB, MAX_LEN = 100, 32


def tokenized(prompt_ids, check_ids=True, **fields):
    req = client_requests.parse_client_message(gen(**fields))
    validation.check_tokenized(req, prompt_ids, VOCAB, MAX_LEN, check_ids=check_ids)


@pytest.mark.parametrize(
    "prompt_ids, fields, needle",
    [
        ([], {}, "prompt tokenizes to zero tokens"),
        ([1, VOCAB], {}, f"token id {VOCAB} is outside the vocabulary \\[0, {VOCAB}\\)"),
        ([-1, 2], {}, "token id -1 is outside the vocabulary"),
        ([1, 2], {"stop_token_ids": [3, VOCAB + 5]}, f"stop token id {VOCAB + 5} is outside the vocabulary"),
        ([1] * MAX_LEN, {}, f"prompt has {MAX_LEN} tokens; the model's limit is {MAX_LEN} including output"),
        ([1] * 20, {"max_tokens": 13}, "max_tokens=13 with a 20-token prompt exceeds the model length 32; at most 12"),
    ],
)
def test_tokenized_requests_are_checked_against_the_model(prompt_ids, fields, needle) -> None:
    """What needs the token ids and the model: each refusal carries the request's id."""
    with pytest.raises(wire.ProtocolError, match=needle) as info:
        tokenized(prompt_ids, **fields)
    assert info.value.request_id == "r1"


def test_tokenized_requests_that_fit_pass() -> None:
    tokenized([0, VOCAB - 1], stop_token_ids=[VOCAB - 1])
    tokenized([1] * 20, max_tokens=12)  # exactly the model length
    tokenized([VOCAB + 7], check_ids=False)  # ids the tokenizer made are not checked again


def _with_id(rest: bytes, entries: int = 2) -> bytes:
    """A map of ``entries`` whose first entry is request_id "r1", then ``rest`` (its other entries)."""
    return bytes([0x80 | entries]) + msgpack.packb("request_id") + msgpack.packb("r1") + rest


@pytest.mark.parametrize(
    "data, code",
    [
        (_with_id(msgpack.packb("prompt") + b"\xa2\xc3\x28"), wire.MALFORMED),  # invalid UTF-8
        (msgpack.packb({"request_id": "r1", "prompt": "hello"})[:-2], wire.MALFORMED),  # truncated
        (_with_id(msgpack.packb("prompt") + b"\x91" * 2000 + b"\x00"), wire.TOO_LARGE),  # nested too deep
        (_with_id(msgpack.packb("prompt") + b"\xdd\xff\xff\xff\xff"), wire.TOO_LARGE),  # a length beyond the limits
        (_with_id(msgpack.packb("token_ids") + msgpack.packb([1] * (limits.MAX_ARRAY_LEN + 1))), wire.TOO_LARGE),
        (_with_id(msgpack.packb("p") + b"\x00" * (limits.MAX_CLIENT_MESSAGE_BYTES + 1)), wire.TOO_LARGE),  # oversized
        (msgpack.packb({"request_id": "r1", "type": "generate"}) + b"\x00", wire.MALFORMED),  # trailing bytes
    ],
    ids=["utf8", "truncated", "deep", "huge-length", "long-array", "oversized", "trailing"],
)
def test_undecodable_frames_keep_a_readable_request_id(data, code) -> None:
    with pytest.raises(wire.FrameError) as info:
        wire.unpack_map(data)
    assert (info.value.request_id, info.value.code) == ("r1", code)


@pytest.mark.parametrize(
    "data",
    [
        b"",  # empty
        b"\xc1",  # never used in msgpack
        msgpack.packb([1, 2]),  # not a map
        msgpack.packb({"prompt": "x"})[:-1] + b"\xff",  # no request_id
        msgpack.packb({"request_id": 5, "prompt": b"\xff"})[:-1],  # an id that is no string
        msgpack.packb({"request_id": "", "x": 1})[:-1],  # an empty id
        msgpack.packb({"request_id": "x" * (limits.MAX_REQUEST_ID_LEN + 1)})[:-1],  # too long an id
        bytes([0x82]) + msgpack.packb("request_id") + b"\xa2\xc3\x28" + b"\xc1",  # an id that is not UTF-8
        bytes([0x8F]) + b"".join(msgpack.packb(f"k{i}") + b"\x00" for i in range(limits.RECOVER_SCAN_KEYS + 1)),
    ],
    ids=["empty", "reserved", "array", "no-id", "int-id", "empty-id", "long-id", "utf8-id", "id-too-far"],
)
def test_undecodable_frames_without_a_readable_id(data) -> None:
    with pytest.raises(wire.FrameError) as info:
        wire.unpack_map(data)
    assert info.value.request_id is None
    assert wire.recover_request_id(data) is None


def test_recovery_reads_past_other_entries_without_decoding_them() -> None:
    before = msgpack.packb("prompt") + b"\xa2\xc3\x28" + msgpack.packb("x") + msgpack.packb([[[1]]] * 10)
    data = bytes([0x83]) + before + msgpack.packb("request_id") + msgpack.packb("late") + b"\xc1"
    assert wire.recover_request_id(data) == "late"
    with pytest.raises(wire.FrameError) as info:
        wire.unpack_map(data)
    assert info.value.request_id == "late" and info.value.code == wire.MALFORMED


def test_error_codes_of_parsed_messages() -> None:
    cases = [
        ({"type": "generate", "v": 2, "request_id": "r"}, wire.UNSUPPORTED_VERSION),
        ({"type": "nope", "request_id": "r"}, wire.UNKNOWN_TYPE),
        ({"request_id": "r"}, wire.UNKNOWN_TYPE),
        ({"type": "generate", "request_id": "r", "prompt": "x", "top_p": 3}, wire.INVALID_FIELD),
        ({"type": "generate", "request_id": "r", "prompt": ""}, wire.INVALID_INPUT),
    ]
    for msg, code in cases:
        with pytest.raises(wire.ProtocolError) as info:
            client_requests.parse_client_message(msg)
        assert (info.value.code, info.value.request_id) == (code, "r"), msg
    req = client_requests.parse_client_message(
        {"type": "generate", "request_id": "r", "token_ids": [1], "max_tokens": 8}
    )
    for ids, code in (([1] * 10, wire.PROMPT_TOO_LONG), ([99], wire.INVALID_INPUT), ([1] * 3, None)):
        try:
            validation.check_tokenized(req, ids, vocab_size=50, max_model_len=12)
            assert code is None
        except wire.ProtocolError as exc:
            assert exc.code == code, (ids, exc)


@pytest.mark.parametrize("version", [True, 1.0, None, "1", 2])
def test_the_version_is_the_integer_1(version) -> None:
    with pytest.raises(wire.ProtocolError) as exc:
        client_requests.parse_client_message({"type": "stats", "v": version})
    assert exc.value.code == wire.UNSUPPORTED_VERSION


def test_a_null_stream_is_the_default() -> None:
    assert client_requests.parse_client_message(gen(stream=None)).stream is False


@pytest.mark.parametrize(
    "fields", [{"prompt": None}, {"token_ids": [1]}, {"max_tokens": 0}, {"stream": 1}, {"prompt": ""}]
)
def test_a_refused_generate_without_an_id_names_none(fields) -> None:
    """The id assigned to a generate that carried none is the accepted request's: a refusal
    never names an id the client did not send."""
    msg = {k: v for k, v in gen(**fields).items() if k != "request_id"}
    with pytest.raises(wire.ProtocolError) as exc:
        client_requests.parse_client_message(msg)
    assert exc.value.request_id is None


def test_frontend_fields_parse_with_their_defaults() -> None:
    req = client_requests.parse_client_message(gen())
    assert (req.fill_context, req.truncate_prompt_tokens, req.skip_special_tokens, req.include_stop_str_in_output) == (
        False,
        None,
        True,
        False,
    )
    chat = {**gen(prompt=None), "messages": [{"role": "user", "content": "hi"}]}
    req = client_requests.parse_client_message(chat)
    assert (req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs) == (True, False, {})
    req = client_requests.parse_client_message(
        {**chat, "continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert (req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs) == (
        False,
        True,
        {"enable_thinking": False},
    )
    assert client_requests.parse_client_message(gen(fill_context=True)).fill_context
    assert not client_requests.parse_client_message(
        gen(fill_context=True, max_tokens=3)
    ).fill_context  # an explicit max_tokens wins


def test_template_kwargs_are_bounded() -> None:
    chat = {**gen(prompt=None), "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(wire.ProtocolError, match="'chat_template_kwargs' exceeds"):
        client_requests.parse_client_message(
            {**chat, "chat_template_kwargs": {"x": "a" * limits.MAX_TEMPLATE_KWARGS_BYTES}}
        )


def test_seeds_map_to_their_64_bit_pattern() -> None:
    for seed, stored in ((-1, -1), (2**64 - 1, -1), (2**63, -(2**63)), (2**63 - 1, 2**63 - 1), (0, 0)):
        assert client_requests.parse_client_message(gen(seed=seed)).sampling.seed == stored


def test_a_type_of_any_value_is_refused_not_raised() -> None:
    """The message type is looked up among the LoRA commands too: an unhashable one (a list, a
    map) must be an unknown type, not a TypeError that takes the frontend down."""
    for kind in ([1], {"a": 1}, 3.5, None):
        with pytest.raises(wire.ProtocolError) as info:
            client_requests.parse_client_message({"type": kind, "v": 1, "request_id": "r"})
        assert info.value.code in (wire.UNKNOWN_TYPE, wire.INVALID_FIELD)
