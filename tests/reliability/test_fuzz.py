"""Fuzzing bin/serve's client socket: hypothesis-made and mutated frames (random bytes,
truncations, byte flips, deep nesting, huge declared lengths, invalid UTF-8, wrong types,
random maps, extra and empty frames) from a raw DEALER, while a well-behaved client streams
beside it.

The test is its own oracle: :func:`expect` decides from the rules of docs/protocol.md, written
out here (not by asking the server's parser), what each message must get, an error (its
codes, an ``error`` map or a request's error ``final``, the id it names) or a run (a
generate's stream and final, a command's reply), and the server's answer must be that: a
server that accepts what the rules refuse, or refuses what they accept, fails it. Every
message sent is counted. The well-behaved stream's greedy tokens are those of the same
request run alone; afterwards the scheduler holds no KV block and the server still serves.
One server for the module (tests/reliability/conftest.py's ``server``), so the run takes seconds."""

from __future__ import annotations

import itertools
import json
import math
import threading
import time
from dataclasses import dataclass

import msgpack
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.frontend.tokenizer import Tokenizer
from conveyor.protocol import wire
from tests.e2e.serve_harness import dealer

FUZZ_CASES = 1000
GOOD_PROMPT = [(7 * j) % 200 + 10 for j in range(12)]
GOOD_TOKENS = 24


def recv(sock: zmq.Socket, timeout: float = 10.0) -> dict | None:
    if not sock.poll(int(timeout * 1000)):
        return None
    return msgpack.unpackb(sock.recv(), raw=False)


def good_request(sock: zmq.Socket, rid: str) -> list[int]:
    """One greedy streamed request; its tokens (the deltas', checked equal to the final's)."""
    sock.send(
        msgpack.packb(
            {
                "type": "generate",
                "v": 1,
                "request_id": rid,
                "token_ids": GOOD_PROMPT,
                "max_tokens": GOOD_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        )
    )
    streamed = []
    while (msg := recv(sock, 60)) is not None:
        assert msg["request_id"] == rid, msg
        if msg["type"] == "delta":
            streamed += msg["token_ids"]
            continue
        assert msg["type"] == "final" and msg["finish_reason"] == "length", msg
        assert msg["token_ids"] == streamed
        return streamed
    raise AssertionError("the well-behaved request got no final")


# ---------------------------------------------------------------------- the oracle
# docs/protocol.md's rules, written out independently of conveyor.protocol.

MAX_FRAME = 8 * 1024 * 1024
GENERATE_KEYS = {
    "type",
    "v",
    "request_id",
    "prompt",
    "messages",
    "token_ids",
    "stream",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "priority",
    "logprobs",
    "prompt_logprobs",
}
MAX_LOGPROBS = 20  # the server's default --max-logprobs


@dataclass(frozen=True)
class Refusal:
    """The message must be refused with one of ``codes``: as an ``error`` map, or (``final``)
    as the error ``final`` of the request it names; ``rid`` is the id the answer must carry
    (None: the message carried none that is readable; a final then names the id the server
    gave the request it accepted)."""

    codes: frozenset[str]
    final: bool
    rid: str | None
    command: str | None = None  # a refused stats/metrics/profile: the error map names it


@dataclass(frozen=True)
class Runs:
    """The message must be served: ``kind`` is the command (a generate runs to a final that is
    no error; stats, metrics and profile get their reply; an abort of an id not in flight gets
    none). ``refusable``: input-level codes the server may still answer a generate with where
    the rule needs the chat template, which the test does not render."""

    kind: str
    stream: bool = False
    rid: str | None = None
    refusable: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Model:
    vocab_size: int
    max_model_len: int
    tokenizer: Tokenizer


def is_int(v) -> bool:  # msgpack int; a bool is not one
    return type(v) is int


def is_number(v) -> bool:  # an int or a finite float
    return is_int(v) or (type(v) is float and math.isfinite(v))


def is_str(v, longest: int | None = None) -> bool:
    return type(v) is str and 0 < len(v) and (longest is None or len(v) <= longest)


def field_problem(obj: dict) -> bool:
    """True when a field of a generate breaks its rule (docs/protocol.md, the generate table;
    ``null`` means the default, so a null field is never wrong)."""

    def has(name):
        return obj.get(name) is not None

    rules = {
        "stream": lambda v: type(v) is bool,
        "ignore_eos": lambda v: type(v) is bool,
        "max_tokens": lambda v: is_int(v) and v >= 1,
        "temperature": lambda v: is_number(v) and v >= 0,
        "top_p": lambda v: is_number(v) and 0 < v <= 1,
        "top_k": lambda v: is_int(v) and v >= 0,
        "min_p": lambda v: is_number(v) and 0 <= v <= 1,
        "logprobs": lambda v: is_int(v) and 0 <= v <= MAX_LOGPROBS,
        "prompt_logprobs": lambda v: is_int(v) and 0 <= v <= MAX_LOGPROBS,
        "seed": lambda v: is_int(v) and -(2**63) <= v < 2**64,  # any 64-bit integer, signed or not
        "priority": lambda v: is_int(v) and -(2**31) + 1 <= v <= 2**31 - 1,
        "stop": lambda v: is_str(v, 256) or (type(v) is list and len(v) <= 16 and all(is_str(s, 256) for s in v)),
        "stop_token_ids": lambda v: type(v) is list and len(v) <= 1024 and all(is_int(t) and t >= 0 for t in v),
        "prompt": lambda v: type(v) is str,
        "messages": lambda v: (
            type(v) is list
            and len(v) > 0
            and all(type(m) is dict and type(m.get("role")) is str and type(m.get("content")) is str for m in v)
        ),
        "token_ids": lambda v: type(v) is list and len(v) > 0 and all(is_int(t) for t in v),
    }
    if sum(has(k) for k in ("prompt", "messages", "token_ids")) != 1:
        return True
    return any(has(name) and not ok(obj[name]) for name, ok in rules.items())


def expect_generate(obj: dict, rid: str | None, model: Model) -> Refusal | Runs:
    def refuse(*codes: str) -> Refusal:
        return Refusal(frozenset(codes), rid is not None, rid)

    if set(obj) - GENERATE_KEYS:
        return refuse(wire.INVALID_FIELD)
    if obj.get("request_id") is not None and rid is None:
        return Refusal(frozenset({wire.INVALID_FIELD}), False, None)
    if field_problem(obj):
        if obj.get("prompt") == "" and sum(obj.get(k) is not None for k in ("messages", "token_ids")) == 0:
            return refuse(wire.INVALID_INPUT, wire.INVALID_FIELD)  # the empty prompt, unless another field is wrong too
        return refuse(wire.INVALID_FIELD)
    if obj.get("prompt") == "":
        return refuse(wire.INVALID_INPUT)

    # The fields are right, so the request is accepted (under an id of the server's when it
    # carried none) and ends in a final: an error one where the model cannot take its input.
    def cannot(code: str) -> Refusal:
        return Refusal(frozenset({code}), True, rid)

    max_tokens = obj.get("max_tokens") or 16
    stream = bool(obj.get("stream"))
    if obj.get("messages") is not None:
        return Runs("generate", stream, rid, frozenset({wire.INVALID_INPUT, wire.PROMPT_TOO_LONG}))
    if obj.get("token_ids") is not None:
        ids = obj["token_ids"]
        if any(not 0 <= t < model.vocab_size for t in ids):
            return cannot(wire.INVALID_INPUT)
    else:
        ids = model.tokenizer.encode(obj["prompt"])
    if any(t >= model.vocab_size for t in obj.get("stop_token_ids") or []):
        return cannot(wire.INVALID_INPUT)
    if len(ids) + max_tokens > model.max_model_len:
        return cannot(wire.PROMPT_TOO_LONG)
    return Runs("generate", stream, rid)


def expect(frames: list[bytes], model: Model, undecodable_rid: str | None) -> Refusal | Runs:
    """What the server must answer to ``frames`` (``undecodable_rid``: the id an answer to a
    frame that does not decode must name, which the case knows from how it was cut)."""
    if len(frames) != 1 or not frames[0]:
        return Refusal(frozenset({wire.BAD_FRAMES}), False, undecodable_rid)
    try:  # msgpack with the documented decode limits; map keys are strings (or bin)
        obj = msgpack.unpackb(
            frames[0], raw=False, strict_map_key=True, max_array_len=1 << 20, max_map_len=16384, max_ext_len=64
        )
    except Exception:
        return Refusal(frozenset({wire.MALFORMED, wire.TOO_LARGE}), False, undecodable_rid)
    if type(obj) is not dict:
        return Refusal(frozenset({wire.MALFORMED}), False, None)
    rid = obj.get("request_id")
    rid = rid if is_str(rid, 256) else None
    if "v" in obj and not (is_int(obj["v"]) and obj["v"] == 1):  # a version is an int; 1 is the one spoken
        command = obj.get("type") if rid is None and is_str(obj.get("type")) and obj["type"] in wire.COMMANDS else None
        return Refusal(frozenset({wire.UNSUPPORTED_VERSION}), rid is not None, rid, command)
    kind = obj.get("type")
    if kind == "generate":
        return expect_generate(obj, rid, model)
    # A refused command (abort, stats, metrics, profile) gets an error map naming no request:
    # only an abort carries an id, and its refusal is that it has none.
    refused_command = Refusal(frozenset({wire.INVALID_FIELD}), False, None, kind if kind in wire.COMMANDS else None)
    if kind == "abort":
        return Runs("abort") if rid is not None else refused_command
    if kind == "stats":  # its one field; the doc names no others, which are not read
        ok = obj.get("iterations") is None or type(obj["iterations"]) is bool
        return Runs("stats") if ok else refused_command
    if kind == "metrics":
        return refused_command if set(obj) - {"type", "v"} else Runs("metrics")
    if kind in ("load_lora", "unload_lora"):  # the fuzzed server runs without --enable-lora-loading
        name, path = obj.get("lora_name"), obj.get("lora_path")
        fields = {"type", "v", "request_id", "lora_name"} | ({"lora_path"} if kind == "load_lora" else set())
        ok = (
            not set(obj) - fields
            and rid is not None
            and is_str(name, 256)
            and (kind == "unload_lora" or is_str(path, 4096))
        )
        # The refusal names the request whenever its id is valid, bad fields or not: the
        # client waits for the answer under that id.
        return Refusal(frozenset({wire.LORA_LOADING_DISABLED if ok else wire.INVALID_FIELD}), False, rid)
    if kind == "profile":
        window, trace, series = obj.get("window_s"), obj.get("trace"), obj.get("series")
        ok = (
            not set(obj) - {"type", "v", "window_s", "trace", "series"}
            and (window is None or (is_number(window) and 0 < window <= 3600))
            and (trace is None or type(trace) is bool)
            and (series is None or (type(series) is list and len(series) <= 32 and all(is_str(x, 64) for x in series)))
        )
        return Runs("profile") if ok else refused_command
    return Refusal(frozenset({wire.UNKNOWN_TYPE}), rid is not None, rid)


def check_refusal(reply: dict, want: Refusal, frames) -> None:
    assert reply is not None, f"no reply to {frames!r}"
    assert reply["code"] in want.codes, (frames, want, reply)
    if want.final:
        assert reply["type"] == "final" and reply["finish_reason"] == "error" and reply["token_ids"] == [], reply
    else:
        assert reply["type"] == "error", (frames, want, reply)
    if want.final and want.rid is None:
        assert is_str(reply["request_id"]), reply
        return
    assert reply["request_id"] == want.rid, (frames, want, reply)
    assert reply.get("command") == want.command, (frames, want, reply)
    if want.rid is None and want.command is None:  # an error that names no request says why
        assert "no request_id could be read" in (reply.get("message") or reply.get("error")), reply


def check_run(sock: zmq.Socket, reply: dict | None, want: Runs, frames) -> None:
    if want.kind == "abort":  # of an id not in flight: no answer
        assert reply is None, (frames, reply)
        return
    assert reply is not None, f"no reply to {frames!r}"
    if want.kind != "generate":
        assert reply["type"] == want.kind, (frames, want, reply)
        return
    if want.rid is not None:
        assert reply["request_id"] == want.rid, (frames, reply)
    if reply["type"] == "final" and reply["finish_reason"] == "error" and reply["code"] in want.refusable:
        return
    while reply["type"] == "delta":
        assert want.stream, (frames, reply)
        reply = recv(sock, 60)
        assert reply is not None, f"no final for {frames!r}"
    assert reply["type"] == "final" and reply["finish_reason"] in ("stop", "length"), (frames, want, reply)


# ---------------------------------------------------------------------- fuzz frames
# A case is (frames, the id an answer must name if a frame does not decode, or None when it
# need not be readable). Every id is RID_SLOT, replaced by a fresh id of the same length at
# each send, so no message continues or collides with an earlier one.
RID_SLOT = "fz-@@@@@@@@"


def _head() -> bytes:
    """The first entry of a map (the caller writes its header): ``request_id: RID_SLOT``."""
    return msgpack.packb("request_id") + msgpack.packb(RID_SLOT)


def _base(extra: dict) -> bytes:
    return msgpack.packb(
        {"request_id": RID_SLOT, "type": "generate", "v": 1, "prompt": "Say:", "max_tokens": 2, **extra}
    )


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.integers(-3, 300),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
FIELDS = sorted(GENERATE_KEYS - {"request_id", "type"}) + ["iterations", "window_s", "trace", "series", "junk"]
# Values at and beside each bounded field's limits (and of a near type), where a parser's
# range check is most easily wrong.
EDGES = {
    "max_tokens": [-1, 0, 1, 2, 1.0, True],
    "temperature": [-1e-9, 0, 0.0, 2, float("inf"), float("nan")],
    "top_p": [0, 0.0, 1e-9, 1, 1.0000001, -0.5],
    "top_k": [-1, 0, 1, 1.0, False],
    "min_p": [-1e-9, 0, 1, 1.0000001, float("nan")],
    "logprobs": [-1, 0, MAX_LOGPROBS, MAX_LOGPROBS + 1, 1.0, True],
    "prompt_logprobs": [-1, 0, MAX_LOGPROBS, MAX_LOGPROBS + 1, 1.0, False],
    "seed": [-(2**63), -1, 0, 2**63, 2**64 - 1, 1.0],  # msgpack holds no integer beyond these
    "priority": [-(2**31), -(2**31) + 1, 2**31 - 1, 2**31, 0.5],
    "stop_token_ids": [[-1], [0], [2**31], [1.0], [], [0] * 1024, [0] * 1025],
    "stop": ["", [""], ["x"] * 16, ["x"] * 17, "y" * 256, "y" * 257, []],
    "token_ids": [[], [-1], [0], [2**40], [True]],
    "v": [0, 1, 2, True, 1.0, None],
}


@st.composite
def cases(draw) -> tuple[list[bytes], str | None]:
    kind = draw(
        st.sampled_from(
            [
                "bytes",
                "truncated",
                "flipped",
                "deep",
                "huge",
                "utf8",
                "wrong_type",
                "edge",
                "edge",
                "request_id",
                "map",
                "frames",
                "empty",
            ]
        )
    )
    if kind == "bytes":
        return [draw(st.binary(max_size=300))], None
    if kind == "truncated":  # cut anywhere: the id is readable once its value is whole
        frame = _base({})
        cut = draw(st.integers(0, len(frame) - 1))
        return [frame[:cut]], (RID_SLOT if cut >= 1 + len(_head()) else None)
    if kind == "flipped":  # bytes after the id replaced (the id stays whole)
        frame = bytearray(_base({"stop": "x"}))
        for _ in range(draw(st.integers(1, 4))):
            frame[draw(st.integers(1 + len(_head()), len(frame) - 1))] = draw(st.integers(0, 255))
        return [bytes(frame)], RID_SLOT
    if kind == "deep":  # the id, then a value nested past msgpack's 1024 levels
        depth = draw(st.integers(1025, 4000))
        return [b"\x82" + _head() + msgpack.packb("prompt") + b"\x91" * depth + b"\x00"], RID_SLOT
    if kind == "huge":  # the id, then a value that declares a length far beyond the frame
        head = draw(st.sampled_from([b"\xdb", b"\xc6", b"\xdd", b"\xdf"]))  # str32, bin32, array32, map32
        return [b"\x82" + _head() + msgpack.packb("prompt") + head + b"\xff\xff\xff\xf0"], RID_SLOT
    if kind == "utf8":  # the id, then a string that is not UTF-8
        bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80"]))
        return [b"\x82" + _head() + msgpack.packb("prompt") + bytes([0xA0 | len(bad)]) + bad], RID_SLOT
    if kind == "wrong_type":  # a well-formed generate with one field of a random value
        field = draw(st.sampled_from(FIELDS))
        return [_base({field: draw(values)})], None
    if kind == "edge":  # a well-formed generate with one field at or beside its limit
        field = draw(st.sampled_from(sorted(EDGES)))
        other_input = {"prompt": None} if field == "token_ids" else {}  # null: as if absent
        return [_base({**other_input, field: draw(st.sampled_from(EDGES[field]))})], None
    if kind == "request_id":  # a generate whose id is a random value
        return [_base({"request_id": draw(st.one_of(values, st.text(min_size=250, max_size=260)))})], None
    if kind == "map":  # any map, of any type, with or without the id
        keys = st.sampled_from(["type", "v", "request_id", "lora_name", "lora_path", *FIELDS])
        obj = draw(st.dictionaries(keys, st.one_of(values, st.just(RID_SLOT)), max_size=5))
        types = st.sampled_from(["generate", "abort", "stats", "profile", "metrics", "load_lora", "unload_lora", "x"])
        obj["type"] = draw(st.one_of(types, values))
        return [msgpack.packb(obj)], None
    if kind == "frames":  # more than one frame: the id of one is named
        frames = [_base({})] + draw(st.lists(st.binary(max_size=40), min_size=1, max_size=3))
        return draw(st.permutations(frames)), RID_SLOT
    if draw(st.booleans()):
        return [b""], None  # an empty frame
    return [b"", _base({})], RID_SLOT  # REQ's empty delimiter, then a frame with the id


# ---------------------------------------------------------------------- the test


def test_fuzzed_frames_each_get_what_the_protocol_says_while_a_good_stream_is_unchanged(
    server, tiny_checkpoint
) -> None:
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    tokenizer = Tokenizer.from_dir(tiny_checkpoint)
    model = Model(tokenizer.vocab_size, config["max_position_embeddings"], tokenizer)
    ctx = zmq.Context()
    try:
        _run(ctx, server.address, model)
    finally:
        ctx.destroy(linger=0)


def _run(ctx: zmq.Context, address: str, model: Model) -> None:
    good = dealer(ctx, address)
    alone = good_request(good, "alone")
    stop = threading.Event()
    streamed: list[list[int]] = []
    failures: list[BaseException] = []

    def stream_beside() -> None:
        try:
            for n in itertools.count():
                if stop.is_set():
                    return
                streamed.append(good_request(good, f"good-{n}"))
        except BaseException as exc:
            failures.append(exc)

    beside = threading.Thread(target=stream_beside, daemon=True)
    beside.start()
    fuzz = dealer(ctx, address)
    sent = {"refused": 0, "served": 0}

    @settings(
        max_examples=FUZZ_CASES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=cases())
    def one(case) -> None:
        frames, undecodable_rid = case
        rid = f"fz-{sum(sent.values()):08x}"  # RID_SLOT's length: the frames stay well-formed
        frames = [f.replace(RID_SLOT.encode(), rid.encode()) for f in frames]
        want = expect(frames, model, rid if undecodable_rid else None)
        fuzz.send_multipart(frames)
        sent["refused" if isinstance(want, Refusal) else "served"] += 1
        reply = recv(fuzz, 0.5 if isinstance(want, Runs) and want.kind == "abort" else 10)
        if isinstance(want, Refusal):
            check_refusal(reply, want, frames)
        else:
            check_run(fuzz, reply, want, frames)

    one()
    stop.set()
    beside.join(120)
    assert not failures, failures
    assert recv(fuzz, timeout=1.0) is None, "a fuzz message got a second reply"
    # every example was sent (none filtered out), and both kinds of verdict were exercised
    assert sum(sent.values()) >= FUZZ_CASES * 0.95 and sent["refused"] >= 500 and sent["served"] >= 10, sent
    assert streamed and all(tokens == alone for tokens in streamed), (alone, streamed)
    print(
        f"{sent} fuzz messages, each answered as the rules say; {len(streamed)} good streams beside them, all as alone"
    )
    stats = dealer(ctx, address)
    deadline = time.monotonic() + 10
    while True:  # the last abort-free request has finished: every block is free within an iteration
        stats.send(msgpack.packb({"type": "stats", "v": 1}))
        reply = recv(stats)
        if reply["held_blocks"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert reply["held_blocks"] == 0 and reply["in_flight"] == 0, reply
    assert good_request(good, "after") == alone  # still serving
