"""Validation of client maps: every bad field gets an error that names it."""

from __future__ import annotations

import msgpack
import pytest

from conveyor.protocol import messages as cp


def gen(**fields):
    return {"type": "generate", "v": 1, "request_id": "r1", "prompt": "hi", **fields}


def test_valid_generate_parses_all_fields() -> None:
    req = cp.parse_client_message(
        gen(max_tokens=5, temperature=0, top_p=0.5, top_k=3, min_p=0.1, seed=7, stop=["x"], stop_token_ids=[2],
            ignore_eos=True, stream=True)
    )
    assert isinstance(req, cp.GenerateRequest)
    assert req.request_id == "r1" and req.prompt == "hi" and req.stream and req.stop == ["x"]
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (5, 0.0, 0.5, 3, 0.1, 7)
    assert s.stop_token_ids == [2] and s.ignore_eos and s.greedy


def test_request_id_is_assigned_when_absent() -> None:
    msg = gen()
    del msg["request_id"]
    a, b = cp.parse_client_message(msg), cp.parse_client_message(msg)
    assert a.request_id and a.request_id != b.request_id


def test_stop_accepts_single_string() -> None:
    assert cp.parse_client_message(gen(stop="END")).stop == ["END"]


def test_priority_is_an_optional_integer() -> None:
    assert cp.parse_client_message(gen()).priority == 0
    assert cp.parse_client_message(gen(priority=-3)).priority == -3
    for bad in ("high", 1.5, True, 2**40):
        with pytest.raises(cp.ProtocolError, match="'priority'"):
            cp.parse_client_message(gen(priority=bad))


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
        (gen(seed=-1), "'seed'"),
        (gen(seed="x"), "'seed'"),
        (gen(stop=[""]), "'stop'"),
        (gen(stop=[1]), "'stop'"),
        (gen(stop_token_ids=[-1]), "'stop_token_ids'"),
        (gen(ignore_eos="yes"), "'ignore_eos'"),
        (gen(stream=1), "'stream'"),
        (gen(bogus=1), "unknown field"),
        (gen(request_id=""), "'request_id'"),
        ({"type": "abort"}, "request_id"),
    ],
)
def test_bad_fields_are_named(msg, needle) -> None:
    with pytest.raises(cp.ProtocolError, match=needle):
        cp.parse_client_message(msg)


def test_error_keeps_request_id_when_readable() -> None:
    with pytest.raises(cp.ProtocolError) as info:
        cp.parse_client_message(gen(top_p=3))
    assert info.value.request_id == "r1"


@pytest.mark.parametrize("data, needle", [(b"\xc1", "malformed"), (msgpack.packb([1, 2]), "must be a map")])
def test_unpack_rejects_non_maps(data, needle) -> None:
    with pytest.raises(cp.ProtocolError, match=needle):
        cp.unpack_map(data)


def test_unpack_rejects_oversized() -> None:
    with pytest.raises(cp.ProtocolError, match="exceeds"):
        cp.unpack_map(b"\x00" * (cp.MAX_CLIENT_MESSAGE_BYTES + 1))


def test_profile_defaults_and_fields() -> None:
    cmd = cp.parse_client_message({"type": "profile", "v": 1})
    assert isinstance(cmd, cp.ProfileCommand)
    assert (cmd.window_s, cmd.trace, cmd.series) == (cp.DEFAULT_PROFILE_WINDOW_S, False, [])
    cmd = cp.parse_client_message({"type": "profile", "window_s": 5, "trace": True, "series": ["batch_seqs"]})
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
    with pytest.raises(cp.ProtocolError, match=needle):
        cp.parse_client_message({"type": "profile", "v": 1, **fields})
