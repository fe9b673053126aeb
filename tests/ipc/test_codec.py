"""The internal codec: round trips for every message, and validation of bad payloads."""

from __future__ import annotations

import dataclasses
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.ipc import codec
from conveyor.ipc.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    MAX_SLOTS,
    CachedRequestData,
    CachedRequests,
    NewRequestData,
    ProcessReady,
    RequestOutput,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenOutputs,
)

def plain(obj):
    """A message as nested plain values: Int32Array fields (numpy views after decode) as lists."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if dataclasses.is_dataclass(obj):
        return (type(obj).__name__, {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def round_trip(msg):
    decoded = codec.decode(codec.encode(msg))
    assert plain(decoded) == plain(msg)
    return decoded


def framed(header: bytes, data: bytes = b"") -> bytes:
    """A message buffer with a hand-made header: length prefix, header, padding, array data."""
    head = struct.pack("<I", len(header)) + header
    return head + bytes(-len(head) % 8) + data


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


slot_lists = st.lists(st.integers(min_value=0, max_value=MAX_SLOTS - 1), max_size=20)


@given(
    rid=st.text(min_size=1, max_size=20),
    prompt=token_lists,
    params=sampling,
    blocks=token_lists,
    n=st.integers(0, 10),
    slots=slot_lists,
)
def test_round_trip_plan_and_request(rid, prompt, params, blocks, n, slots) -> None:
    plan = StepPlan(
        step_id=n,
        new_requests=[NewRequestData(rid, n, prompt, params, blocks, 0, len(prompt))],
        cached_requests=[CachedRequestData(slot, blocks, n, 1) for slot in slots],
        finished_slots=slots[::-1],
    )
    decoded = round_trip(plan)
    new = decoded.new_requests[0]
    assert new.token_ids.dtype == np.int32 and new.token_ids.tolist() == prompt
    assert new.request_id == rid and new.slot == n
    # The per-request columns and the drops are raw int32 arrays.
    cached = decoded.cached_requests
    for column in (cached.slots, cached.num_computed_tokens, cached.num_scheduled_tokens, decoded.finished_slots):
        assert type(column) is np.ndarray and column.dtype == np.int32
    assert cached.slots.tolist() == slots and decoded.finished_slots.tolist() == slots[::-1]
    assert [row.slot for row in cached.rows()] == slots and all(type(row.slot) is int for row in cached.rows())
    round_trip(AddRequest(rid, prompt, params, 1.5))


def test_plan_header_carries_no_per_request_strings() -> None:
    """With slots, a decode step's header is the same size whatever the request ids: the
    per-request columns, drops and result rows are all int32 arrays."""
    n = 256
    cached = CachedRequests(list(range(n)), list(range(100, 100 + n)), [1] * n)
    head = codec.encode_parts(StepPlan(7, [], cached, list(range(8))))[0]
    assert len(head) < 64
    head = codec.encode_parts(StepResult(7, list(range(n)), [11] * n))[0]
    assert len(head) < 64


def test_round_trip_outputs_and_results() -> None:
    out = TokenOutputs([RequestOutput("a", [1], None), RequestOutput("b", [], "error", "boom", 1.0, 2.0)])
    round_trip(out)
    round_trip(StepResult(3, [4, 0], [5, 6], None, 0.25))
    round_trip(ProcessReady("worker", 12, {"num_blocks": 7, "device": "cpu"}))


def test_arrays_travel_raw_and_decode_as_views() -> None:
    """An Int32Array field is raw int32 bytes after the header, and decodes with no copy."""
    tokens = np.arange(1000, dtype=np.int32)
    parts = codec.encode_parts(StepResult(1, [], tokens))
    assert len(parts) == 2 and bytes(parts[1]) == tokens.tobytes()  # handed out uncopied, no msgpack ints
    buf = bytearray(b"".join(parts))
    res = codec.decode(memoryview(buf))
    assert res.sampled_token_ids.tolist() == tokens.tolist()
    buf[-4:] = (77).to_bytes(4, "little")  # a view: the buffer's bytes are the array's
    assert res.sampled_token_ids[-1] == 77


@pytest.mark.parametrize("values", [[1, 2, 3], np.array([1, 2, 3], dtype=np.int64), np.array([], dtype=np.float32)])
def test_array_fields_take_any_int_sequence(values) -> None:
    res = codec.decode(codec.encode(StepResult(1, list(range(len(values))), values)))
    assert res.sampled_token_ids.tolist() == list(values)


@pytest.mark.parametrize("values", [[2**31], np.array([2**40]), np.array([1.5]), np.zeros((2, 2), dtype=np.int32)])
def test_array_fields_refuse_what_int32_cannot_hold(values) -> None:
    with pytest.raises((TypeError, OverflowError)):
        codec.encode(StepResult(1, [], values))


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
        (b"", "shorter than its length prefix"),
        (struct.pack("<I", 100) + b"\x90", "overruns"),
        (framed(b"\xc1"), "malformed msgpack"),
        (framed(msgpack.packb({"a": 1})), "array"),
        (framed(msgpack.packb([999, PROTOCOL_VERSION])), "unknown message tag"),
        (framed(msgpack.packb([AbortRequests.TAG, PROTOCOL_VERSION + 1, ["a"]])), "version"),
        (framed(msgpack.packb([AbortRequests.TAG, PROTOCOL_VERSION])), "1 fields, got 0"),
        (framed(msgpack.packb([AbortRequests.TAG, PROTOCOL_VERSION, "a"])), "request_ids: expected array"),
        (framed(msgpack.packb([AbortRequests.TAG, PROTOCOL_VERSION, [1]])), "expected array of str, found int"),
        (framed(msgpack.packb([AddRequest.TAG, PROTOCOL_VERSION, "r", [1, True], [], 0.0, 0])), "array of int"),
        (framed(msgpack.packb([AddRequest.TAG, PROTOCOL_VERSION, "r", [1, "x"], [], 0.0, 0])), "array of int"),
        (framed(msgpack.packb([AddRequest.TAG, PROTOCOL_VERSION, "r", [1], [1, 2], 0.0, 0])), "SamplingParams has"),
        (framed(msgpack.packb([StepResult.TAG, PROTOCOL_VERSION, 1.5, [0, 0], [0, 0], None, 0.0])), "expected int"),
        (framed(msgpack.packb([StepResult.TAG, PROTOCOL_VERSION, 1, [0, 0], [0, 0], 3, 0.0])), "error"),
        (framed(msgpack.packb([StepResult.TAG, PROTOCOL_VERSION, 1, [0, 0], [0, 0], None, True])), "expected float"),
        (framed(msgpack.packb([StepResult.TAG, PROTOCOL_VERSION, 1, [0, 0], [0, 1], None, 0.0])), "outside the message"),
        (framed(msgpack.packb([StepResult.TAG, PROTOCOL_VERSION, 1, [0, 0], [2, 1], None, 0.0]), bytes(8)), "outside"),
        (framed(msgpack.packb([StepResult.TAG, PROTOCOL_VERSION, 1, [0, 0], [-4, 1], None, 0.0]), bytes(8)), "outside"),
        (framed(msgpack.packb([StepResult.TAG, PROTOCOL_VERSION, 1, [0, 0], [5, 0], None, 0.0]), bytes(8)), "outside"),
        (framed(msgpack.packb([StepResult.TAG, PROTOCOL_VERSION, 1, [0, 0], [1, 2, 3], None, 0.0])), "array reference"),
        (framed(msgpack.packb([StepResult.TAG, PROTOCOL_VERSION, 1, ["a"], [0, 0], None, 0.0])), "StepResult.slots"),
        (framed(msgpack.packb([StepResult.TAG, PROTOCOL_VERSION, 1, [0, 1], [0, 0], None, 0.0])), "slots.*outside"),
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
