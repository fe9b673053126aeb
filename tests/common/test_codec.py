"""The internal codec: round trips for every message, and validation of bad payloads."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.common import codec
from conveyor.common.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    CachedRequestData,
    NewRequestData,
    ProcessReady,
    RequestOutput,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenOutputs,
)

token_lists = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=50)
sampling = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 4096),
    temperature=st.floats(0, 2),
    top_p=st.floats(0.01, 1),
    top_k=st.integers(0, 100),
    min_p=st.floats(0, 1),
    seed=st.none() | st.integers(0, 2**62),
    stop_token_ids=token_lists,
    ignore_eos=st.booleans(),
)


@given(
    rid=st.text(min_size=1, max_size=20),
    prompt=token_lists,
    params=sampling,
    blocks=token_lists,
    n=st.integers(0, 10),
)
def test_round_trip_plan_and_request(rid, prompt, params, blocks, n) -> None:
    plan = StepPlan(
        step_id=n,
        new_requests=[NewRequestData(rid, prompt, params, blocks, 0, len(prompt))],
        cached_requests=[CachedRequestData(rid + "x", blocks, n, 1)],
        finished_request_ids=[rid] * n,
    )
    assert codec.decode(codec.encode(plan)) == plan
    add = AddRequest(rid, prompt, params, 1.5)
    assert codec.decode(codec.encode(add)) == add


def test_round_trip_outputs_and_results() -> None:
    out = TokenOutputs([RequestOutput("a", [1], None), RequestOutput("b", [], "error", "boom", 1.0, 2.0)])
    assert codec.decode(codec.encode(out)) == out
    res = StepResult(3, ["a", "b"], [5, 6], None, 0.25)
    assert codec.decode(codec.encode(res)) == res
    ready = ProcessReady("worker", 12, {"num_blocks": 7, "device": "cpu"})
    assert codec.decode(codec.encode(ready)) == ready


def test_every_registered_message_has_distinct_tag() -> None:
    assert len({cls.TAG for cls in MESSAGE_TYPES.values()}) == len(MESSAGE_TYPES)


def test_encode_rejects_unregistered_objects() -> None:
    with pytest.raises(TypeError):
        codec.encode({"type": "x"})
    with pytest.raises(TypeError):
        codec.encode(SamplingParams())


@pytest.mark.parametrize(
    "payload, needle",
    [
        (b"\xc1", "malformed msgpack"),
        (msgpack.packb({"a": 1}), "array"),
        (msgpack.packb([999, PROTOCOL_VERSION]), "unknown message tag"),
        (msgpack.packb([AbortRequests.TAG, PROTOCOL_VERSION + 1, ["a"]]), "version"),
        (msgpack.packb([AbortRequests.TAG, PROTOCOL_VERSION]), "1 fields, got 0"),
        (msgpack.packb([AbortRequests.TAG, PROTOCOL_VERSION, "a"]), "request_ids: expected array"),
        (msgpack.packb([AbortRequests.TAG, PROTOCOL_VERSION, [1]]), "expected str"),
        (msgpack.packb([AddRequest.TAG, PROTOCOL_VERSION, "r", [1, True], [], 0.0, 0]), "array of int"),
        (msgpack.packb([AddRequest.TAG, PROTOCOL_VERSION, "r", [1, "x"], [], 0.0, 0]), "array of int"),
        (msgpack.packb([AddRequest.TAG, PROTOCOL_VERSION, "r", [1], [1, 2], 0.0, 0]), "SamplingParams has"),
        (msgpack.packb([StepResult.TAG, PROTOCOL_VERSION, 1.5, [], [], None, 0.0]), "expected int"),
        (msgpack.packb([StepResult.TAG, PROTOCOL_VERSION, 1, [], [], 3, 0.0]), "error"),
        (msgpack.packb([StepResult.TAG, PROTOCOL_VERSION, 1, [], [], None, True]), "expected float"),
    ],
)
def test_decode_names_the_problem(payload: bytes, needle: str) -> None:
    with pytest.raises(codec.DecodeError, match=needle):
        codec.decode(payload)


@given(st.binary(max_size=64))
def test_decode_never_crashes_on_garbage(data: bytes) -> None:
    try:
        codec.decode(data)
    except codec.DecodeError:
        pass
