"""The internal codec: round trips for every message, and validation of bad payloads."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.ipc import codec
from conveyor.ipc.messages import (
    MAX_SLOTS,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    CachedRequests,
    NewRequestData,
    ProcessReady,
    RequestOutput,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenOutputs,
)
from tests.plans import CachedRow, columns, rows


def plain(obj):
    """A message as nested plain values: Int32Array fields (numpy views after decode) as lists."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, msgspec.Struct):
        return (type(obj).__name__, {f.name: plain(getattr(obj, f.name)) for f in msgspec.structs.fields(obj)})
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def round_trip(msg):
    decoded = codec.decode(codec.encode(msg))
    assert plain(decoded) == plain(msg)
    return decoded


def framed(body, version: int = PROTOCOL_VERSION) -> bytes:
    """A message buffer with a hand-made body: the version byte, then ``body`` as msgpack."""
    return bytes([version]) + msgspec.msgpack.encode(body)


def ints(*values: int, code: int = codec.INT32_EXT) -> msgspec.msgpack.Ext:
    """A hand-made Int32Array on the wire."""
    return msgspec.msgpack.Ext(code, np.array(values, dtype="<i4").tobytes())


NO_INTS = ints()


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
        cached_requests=columns(CachedRow(slot, blocks, n, 1) for slot in slots),
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
    assert [row.slot for row in rows(cached)] == slots and all(type(row.slot) is int for row in rows(cached))
    add = round_trip(AddRequest(rid, prompt, params, 1.5))
    assert add.prompt_token_ids.dtype == np.int32  # the prompt travels raw, like the plan's arrays


def test_plan_header_carries_no_per_request_strings() -> None:
    """With slots, a decode step's header is the same size whatever the request ids: the
    per-request columns, drops and result rows are all int32 arrays."""
    n = 256
    cached = CachedRequests(list(range(n)), list(range(100, 100 + n)), [1] * n)
    assert len(codec.encode(StepPlan(7, [], cached, list(range(8))))) - 4 * (3 * n + 8) < 64
    assert len(codec.encode(StepResult(7, list(range(n)), [11] * n))) - 4 * 2 * n < 64


def test_round_trip_outputs_and_results() -> None:
    out = TokenOutputs([RequestOutput("a", [1], None), RequestOutput("b", [], "error", "boom", 1.0, 2.0)])
    round_trip(out)
    round_trip(StepResult(3, [4, 0], [5, 6], None, 0.25))
    round_trip(ProcessReady("worker", 12, {"num_blocks": 7, "device": "cpu"}))


def test_arrays_travel_raw_and_decode_as_views() -> None:
    """An Int32Array field is raw int32 bytes in the message, and decodes with no copy."""
    tokens = np.arange(1000, dtype=np.int32)
    data = codec.encode(StepResult(1, [], tokens))
    start = data.find(tokens.tobytes())
    assert start > 0 and len(data) - len(tokens.tobytes()) < 32  # raw bytes, no msgpack ints
    assert codec.encode_parts(StepResult(1, [], tokens)) == [data]
    buf = bytearray(data)
    res = codec.decode(memoryview(buf))
    assert res.sampled_token_ids.tolist() == tokens.tolist()
    end = start + tokens.nbytes
    buf[end - 4 : end] = (77).to_bytes(4, "little")  # a view: the buffer's bytes are the array's
    assert res.sampled_token_ids[-1] == 77


def test_encode_leaves_the_message_as_it_was() -> None:
    """Lists in Int32Array fields are packed in a copy: the sender's message keeps its lists."""
    plan = StepPlan(
        1, [NewRequestData("a", 0, [1, 2], SamplingParams(), [3], 0, 2)], columns([CachedRow(0, [], 2, 1)]), [4]
    )
    before = plain(plan)
    codec.encode(plan)
    assert plain(plan) == before and type(plan.finished_slots) is list and type(plan.new_requests[0].token_ids) is list


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
        (b"", "empty message"),
        (framed([AbortRequests.TAG, ["abc"]])[:-1], "malformed msgpack.*truncated"),
        (bytes([PROTOCOL_VERSION]) + b"\xc1", "malformed msgpack"),
        (framed({"a": 1}), "array"),
        (framed([999]), "unknown message tag 999"),
        (framed(["x", ["a"]]), "unknown message tag 'x'"),
        (framed([AbortRequests.TAG, ["a"]], version=PROTOCOL_VERSION + 1), "version"),
        (framed([AbortRequests.TAG]), "AbortRequests: expected array of at least length"),
        (framed([AbortRequests.TAG, ["a"], 1]), "AbortRequests: expected array of at most length"),
        (framed([AbortRequests.TAG, "a"]), r"AbortRequests.request_ids: expected array, got str"),
        (framed([AbortRequests.TAG, [1]]), r"AbortRequests.request_ids\[0\]: expected str, got int"),
        (
            framed([RequestOutput.TAG, "r", [1, True], None, None, None, None, 0]),
            r"new_token_ids\[1\]: expected int, got bool",
        ),
        (
            framed([RequestOutput.TAG, "r", [1, "x"], None, None, None, None, 0]),
            r"new_token_ids\[1\]: expected int, got str",
        ),
        (
            framed([AddRequest.TAG, "r", NO_INTS, [*msgspec.structs.astuple(SamplingParams()), 9], 0.0, 0]),
            f"AddRequest.sampling: expected array of at most length {len(msgspec.structs.fields(SamplingParams))}",
        ),
        (
            framed([AddRequest.TAG, "r", NO_INTS, [1, "x"], 0.0, 0]),
            r"AddRequest.sampling.temperature: expected float, got str",
        ),
        (
            framed([AddRequest.TAG, "r", [1, 2], [], 0.0, 0]),
            "AddRequest.prompt_token_ids: expected int32 array, got list",
        ),
        (framed([StepResult.TAG, 1.5, NO_INTS, NO_INTS, None, 0.0]), "StepResult.step_id: expected int, got float"),
        (framed([StepResult.TAG, 1, NO_INTS, NO_INTS, 3, 0.0]), r"StepResult.error: expected str \| null, got int"),
        (
            framed([StepResult.TAG, 1, NO_INTS, NO_INTS, None, True]),
            "StepResult.forward_time: expected float, got bool",
        ),
        (framed([StepResult.TAG, ints(1), NO_INTS, NO_INTS, None, 0.0]), "StepResult.step_id: expected int, got ext"),
        (
            framed([StepResult.TAG, 1, NO_INTS, msgspec.msgpack.Ext(codec.INT32_EXT, b"\0\0\0"), None, 0.0]),
            "sampled_token_ids: int32 array of 3 bytes is not a whole number",
        ),
        (
            framed([StepResult.TAG, 1, ints(1, code=7), NO_INTS, None, 0.0]),
            "StepResult.slots: unknown msgpack ext type 7",
        ),
        (
            framed([StepResult.TAG, 1, [1, 2, 3], NO_INTS, None, 0.0]),
            "StepResult.slots: expected int32 array, got list",
        ),
        (framed([StepResult.TAG, 1, ["a"], NO_INTS, None, 0.0]), "StepResult.slots"),
        (
            framed(
                [
                    StepPlan.TAG,
                    1,
                    [[NewRequestData.TAG, "a", 0, ints(1), [], ints(1, code=2), 0, 1]],
                    [NO_INTS, NO_INTS, NO_INTS],
                    NO_INTS,
                ]
            ),
            r"StepPlan.new_requests\[0\].block_ids: unknown msgpack ext type 2",
        ),
        (framed([ProcessReady.TAG, "worker", 1, {3: 1}]), "ProcessReady.info key: expected str, got int"),
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
