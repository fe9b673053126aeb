"""A request id names a request only within its client (frontend/server.py, "Clients"): client B
can neither abort, continue nor probe client A's request by its id, two clients' requests under
one id are two requests, and a client that reconnects with a stable routing id continues its
own conversation. A live frontend loop runs on a thread against a stand-in scheduler
(tests/frontend/conftest.py: ``LiveFrontend``), so every ordering is forced, not raced."""

from __future__ import annotations

import pytest

from conveyor.checkpoints.demo.checkpoint import TOKENIZER_DIR
from conveyor.frontend.tokenizer import Tokenizer
from conveyor.ipc.messages import AbortRequests, AddRequest, RequestOutput, TokenOutputs
from tests.frontend.conftest import LiveFrontend


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(TOKENIZER_DIR)


@pytest.fixture
def fe(tok):
    frontend = LiveFrontend(tok)
    yield frontend
    frontend.stop()


def client(fe: LiveFrontend, routing_id: bytes | None = None):
    sock = fe.client()
    if routing_id is not None:  # set before connecting: close the default one, open a named one
        sock.close(linger=0)
        sock = fe.ctx.socket(fe.zmq.DEALER)
        sock.setsockopt(fe.zmq.LINGER, 0)
        sock.setsockopt(fe.zmq.ROUTING_ID, routing_id)
        sock.connect(fe.addresses.client)
    return sock


def submit(fe: LiveFrontend, sock, rid: str, prompt: str = "Say:") -> AddRequest:
    fe.send(sock, type="generate", request_id=rid, prompt=prompt, max_tokens=50, stream=True)
    add = fe.scheduler_recv()
    assert isinstance(add, AddRequest), add
    return add


def finish(fe: LiveFrontend, sock, sid: str, token: int) -> dict:
    fe.scheduler_send(TokenOutputs([RequestOutput(sid, [token], finish_reason="length")]))
    return fe.until_final(sock)[-1]


def test_b_can_neither_abort_nor_probe_the_request_of_a_and_runs_its_own_under_its_id(fe, tok) -> None:
    a, b = client(fe), client(fe)
    add_a = submit(fe, a, "x")
    fe.send(b, type="abort", request_id="x")  # B aborts "x": B has no "x", so nothing happens
    assert fe.recv(b, timeout=0.3) is None and fe.scheduler_recv(timeout=0.3) is None
    fe.scheduler_send(fe.first_token(add_a.request_id, 300))
    assert fe.recv(a)["token_ids"] == [300]  # A's request goes on
    # B's generate under "x" is no probe: no "already in flight", it is B's own request
    add_b = submit(fe, b, "x", prompt="Hello there")
    assert add_b.request_id != add_a.request_id and add_b.prompt_token_ids == tok.encode("Hello there")
    # each stream gets its own tokens under its own client's "x"
    fe.scheduler_send(TokenOutputs([], [add_a.request_id, add_b.request_id], [301, 302]))
    assert (fe.recv(a)["token_ids"], fe.recv(b)["token_ids"]) == ([301], [302])
    fe.send(b, type="abort", request_id="x")  # B's abort ends B's "x" alone
    aborted = fe.until_final(b)[-1]
    assert (aborted["request_id"], aborted["finish_reason"], aborted["token_ids"]) == ("x", "abort", [302])
    abort = fe.scheduler_recv()
    assert isinstance(abort, AbortRequests) and abort.request_ids == [add_b.request_id]
    final = finish(fe, a, add_a.request_id, 303)
    assert (final["finish_reason"], final["token_ids"]) == ("length", [300, 301, 303])
    assert not fe.frontend.in_flight and not fe.frontend.requests


def test_b_cannot_continue_the_request_of_a(fe, tok) -> None:
    a, b = client(fe), client(fe)
    first = submit(fe, a, "chat")
    assert finish(fe, a, first.request_id, 300)["finish_reason"] == "length"
    context = first.prompt_token_ids + [300]
    fresh = submit(fe, b, "chat", prompt="Hello there")  # B's "chat" starts fresh: BOS, no A context
    assert fresh.prompt_token_ids == tok.encode("Hello there")
    assert finish(fe, b, fresh.request_id, 301)["usage"]["prompt_tokens"] == len(fresh.prompt_token_ids)
    turn = submit(fe, a, "chat", prompt="Hello there")  # A's context is untouched by B's turn
    assert turn.prompt_token_ids == context + tok.encode("Hello there", add_special_tokens=False)


def test_a_stable_identity_continues_across_a_reconnect(fe, tok) -> None:
    a = client(fe, b"client-a-stable-id")
    first = submit(fe, a, "chat")
    assert finish(fe, a, first.request_id, 300)["finish_reason"] == "length"
    a.close(linger=0)
    a2 = client(fe, b"client-a-stable-id")  # a new connection under the same routing id
    turn = submit(fe, a2, "chat", prompt="Hello there")
    assert turn.prompt_token_ids == first.prompt_token_ids + [300] + tok.encode("Hello there", add_special_tokens=False)
    final = finish(fe, a2, turn.request_id, 301)
    assert (final["request_id"], final["token_ids"], final["usage"]["prompt_tokens"]) == (
        "chat",
        [301],
        len(turn.prompt_token_ids),
    )
    other = client(fe, b"client-b-other-id")  # another identity: its "chat" is new
    assert submit(fe, other, "chat", prompt="Hello there").prompt_token_ids == tok.encode("Hello there")


def test_a_duplicate_in_flight_id_is_refused_without_ending_the_request(fe) -> None:
    a = client(fe)
    add = submit(fe, a, "d")
    fe.send(a, type="generate", request_id="d", prompt="Hi", max_tokens=4)
    refused = fe.recv(a)
    assert (refused["type"], refused["request_id"], refused["code"]) == ("error", "d", "duplicate_request_id")
    # a refused message with bad fields under an in-flight id is no final either
    fe.send(a, type="generate", request_id="d", prompt="Hi", top_p=7)
    bad = fe.recv(a)
    assert (bad["type"], bad["request_id"], bad["code"]) == ("error", "d", "invalid_field")
    assert fe.scheduler_recv(timeout=0.2) is None
    final = finish(fe, a, add.request_id, 300)  # the one final under "d" is the request's own
    assert (final["finish_reason"], final["token_ids"]) == ("length", [300])
    assert fe.recv(a, timeout=0.2) is None


def test_a_takeover_of_an_identity_drops_the_old_connections_requests_only(fe) -> None:
    """A second connection under a connected routing id takes it over (ROUTER_HANDOVER): at its
    first message the old connection's requests are aborted at the scheduler (nothing could
    read their replies any more), before that message is handled, so the new connection may
    use the same request id at once; the new connection's requests go on, also when the old
    connection then closes."""
    old = client(fe, b"client-handover-id")
    first = submit(fe, old, "r1")
    new = client(fe, b"client-handover-id")
    fe.send(new, type="generate", request_id="r1", prompt="Say:", max_tokens=50, stream=True)
    abort = fe.scheduler_recv()
    assert isinstance(abort, AbortRequests) and abort.request_ids == [first.request_id], abort
    second = fe.scheduler_recv()
    assert isinstance(second, AddRequest) and second.request_id != first.request_id, second
    old.close(linger=0)
    assert fe.scheduler_recv(timeout=0.3) is None
    final = finish(fe, new, second.request_id, 300)
    assert (final["request_id"], final["finish_reason"], final["token_ids"]) == ("r1", "length", [300])
