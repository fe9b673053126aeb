"""Issue 43 finding 5 on the ZeroMQ face: one client's sequences in flight (prompts x ``n``) are
at most a quarter of ``--max-waiting`` (conveyor.frontend.shares), so a client sending 1,024
requests of ``n`` = 64 cannot fill the waiting queue: past its share it gets ``overloaded``
finals, and another client is served meanwhile. The HTTP process's connection (the internal
endpoint) is exempt: it bounds each HTTP request itself. A live frontend loop against a
stand-in scheduler (tests/frontend/conftest.py), so the counts are exact."""

from __future__ import annotations

import msgpack
import pytest

from conveyor.checkpoints.demo.checkpoint import TOKENIZER_DIR
from conveyor.frontend.tokenizer import Tokenizer
from conveyor.ipc.messages import AddRequest, RequestOutput, TokenOutputs
from tests.frontend.conftest import LiveFrontend

MAX_WAITING = 4096
SHARE = MAX_WAITING // 4


@pytest.fixture
def fe():
    frontend = LiveFrontend(Tokenizer.from_dir(TOKENIZER_DIR), max_waiting=MAX_WAITING)
    yield frontend
    frontend.stop()


def added(fe: LiveFrontend, expected: int) -> list[AddRequest]:
    """The requests the frontend sends the scheduler (its other messages, stats queries,
    skipped): ``expected`` of them (within 10 s each on a loaded machine), then any more that
    come within half a second (there should be none)."""
    out = []
    while len(out) < expected and (msg := fe.scheduler_recv(timeout=10)) is not None:
        if isinstance(msg, AddRequest):
            out.append(msg)
    while (msg := fe.scheduler_recv(timeout=0.5)) is not None:
        if isinstance(msg, AddRequest):
            out.append(msg)
    return out


def next_add(fe: LiveFrontend) -> AddRequest | None:
    while (msg := fe.scheduler_recv()) is not None:
        if isinstance(msg, AddRequest):
            return msg
    return None


def finals(fe: LiveFrontend, sock, count: int) -> list[dict]:
    got = []
    while len(got) < count and (msg := fe.recv(sock, timeout=10)) is not None:
        got.append(msg)
    return got


def test_one_client_cannot_take_the_queue(fe) -> None:
    greedy, other = fe.client(), fe.client()
    for i in range(1024):  # 1,024 prompts x n = 64: 65,536 sequences
        greedy.send(
            msgpack.packb(
                {"v": 1, "type": "generate", "request_id": f"g{i}", "prompt": "Say:", "n": 64, "max_tokens": 4}
            )
        )
    refusals = finals(fe, greedy, 1024 - SHARE // 64)
    assert len(refusals) == 1024 - SHARE // 64
    assert all(r["type"] == "final" and r["finish_reason"] == "error" for r in refusals), refusals[0]
    assert refusals[0]["error"].startswith("overloaded:") and f"at most {SHARE}, a quarter" in refusals[0]["error"]
    taken = added(fe, SHARE // 64)
    assert len(taken) == SHARE // 64 and sum(a.sampling.n for a in taken) == SHARE
    fe.send(other, type="generate", request_id="mine", prompt="Hello", max_tokens=4)
    assert next_add(fe) is not None  # the other client is served
    # The share comes back as the greedy client's requests end: one finished, one more fits.
    fe.scheduler_send(
        TokenOutputs([RequestOutput(f"{taken[0].request_id}/{i}", [5], finish_reason="length") for i in range(64)])
    )
    assert fe.until_final(greedy)[-1]["finish_reason"] == "length"
    fe.send(greedy, type="generate", request_id="again", prompt="Say:", n=64, max_tokens=4)
    assert next_add(fe) is not None
    fe.send(greedy, type="generate", request_id="too-many", prompt="Say:", max_tokens=4)
    assert fe.until_final(greedy)[-1]["error"].startswith("overloaded:")


def test_a_gone_client_gives_its_share_back_and_the_internal_endpoint_is_exempt(fe) -> None:
    sock = fe.client()
    for i in range(SHARE // 64):
        fe.send(sock, type="generate", request_id=f"r{i}", prompt="Say:", n=64, max_tokens=4)
    assert len(added(fe, SHARE // 64)) == SHARE // 64 and sum(fe.frontend.shares.held.values()) == SHARE
    sock.close(linger=0)  # its requests are dropped: nothing of its share is left held
    assert fe.wait_for(lambda: not fe.frontend.shares.held, timeout=20)
    internal = fe.ctx.socket(fe.zmq.DEALER)
    internal.setsockopt(fe.zmq.LINGER, 0)
    internal.connect(fe.addresses.internal_client)  # the HTTP process's endpoint
    for i in range(SHARE // 64 + 4):
        fe.send(internal, type="generate", request_id=f"h{i}", prompt="Say:", n=64, max_tokens=4)
    assert len(added(fe, SHARE // 64 + 4)) == SHARE // 64 + 4 and not fe.frontend.shares.held
