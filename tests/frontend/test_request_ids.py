"""Request ids at the scheduler (frontend/server.py): every submission gets an id of its own
there, so a client that reuses its id (a retry after an abort, a continuation after a stop
string) never receives what the scheduler still sends about the earlier request under it, and
everything the client receives carries its own id. A live frontend loop runs on a thread
against a stand-in scheduler (conftest.py: ``live_frontend``) that sends the late outputs a
real one would: the tokens of steps it ran before it read the abort, then the abort's own
``finish_reason="abort"`` output. The orderings are forced, not raced."""

from __future__ import annotations

from conveyor.ipc.messages import AbortRequests, AddRequest, RequestOutput, SchedulerStats, TokenOutputs

WORDS = " one two three four the and of on"  # one token per word in the demo vocabulary


def words(tok) -> list[int]:
    ids = tok.encode(WORDS, add_special_tokens=False)
    assert len(ids) == 8 and tok.decode(ids) == WORDS
    return ids


def submit(fe, sock, rid: str, prompt: str = "Say:", **fields) -> AddRequest:
    """Send a generate; return the AddRequest the scheduler got for it."""
    fe.send(sock, type="generate", request_id=rid, prompt=prompt, max_tokens=100, stream=True, **fields)
    add = fe.scheduler_recv()
    assert isinstance(add, AddRequest), add
    return add


def late_outputs_of(fe, sid: str, stray: int) -> None:
    """What a scheduler sends about ``sid`` after the frontend let it go: a step it ran before it
    read the abort (a column token), then the abort's finish."""
    fe.scheduler_send(TokenOutputs([], [sid], [stray]))
    fe.scheduler_send(TokenOutputs([RequestOutput(sid, [], finish_reason="abort")]))


def test_late_outputs_of_an_aborted_request_do_not_reach_a_new_one_with_its_id(live_frontend, ours) -> None:
    ids = words(ours["demo"])
    fe = live_frontend()
    sock = fe.client()
    old = submit(fe, sock, "x")
    fe.scheduler_send(fe.first_token(old.request_id, ids[0]))
    assert fe.recv(sock)["token_ids"] == ids[:1]
    fe.send(sock, type="abort", request_id="x")
    aborted = fe.until_final(sock)
    assert aborted[-1]["request_id"] == "x" and aborted[-1]["finish_reason"] == "abort"
    assert aborted[-1]["token_ids"] == ids[:1]
    abort = fe.scheduler_recv()
    assert isinstance(abort, AbortRequests) and abort.request_ids == [old.request_id]
    new = submit(fe, sock, "x", prompt="Hello there")  # the same id, at once: continues the aborted turn
    assert new.prompt_token_ids[: len(old.prompt_token_ids) + 1] == old.prompt_token_ids + ids[:1]
    # The scheduler read the abort only now: a token of the old request, then its abort output.
    late_outputs_of(fe, old.request_id, stray=ids[7])
    assert fe.recv(sock, timeout=0.3) is None  # nothing about the old request reaches the client
    fe.scheduler_send(fe.first_token(new.request_id, ids[1]))
    fe.scheduler_send(TokenOutputs([], [new.request_id], [ids[2]]))
    fe.scheduler_send(TokenOutputs([RequestOutput(new.request_id, [ids[3]], finish_reason="length")]))
    msgs = fe.until_final(sock)  # steps that queued up may come as one delta: compare what they add up to
    assert msgs[-1]["type"] == "final" and all(m["type"] == "delta" for m in msgs[:-1])
    assert all(m["request_id"] == "x" for m in msgs)
    assert [t for m in msgs[:-1] for t in m["token_ids"]] == ids[1:4]
    final = msgs[-1]
    assert final["finish_reason"] == "length" and final["token_ids"] == ids[1:4]
    assert final["text"] == "".join(m["text"] for m in msgs[:-1]) == " two three four"
    assert fe.scheduler_recv(timeout=0.2) is None  # no abort of the new request: it finished at the scheduler
    assert new.request_id != old.request_id  # the scheduler can tell the two apart
    assert not fe.frontend.requests and not fe.frontend.in_flight


def test_late_outputs_after_a_stop_string_do_not_reach_the_continuation(live_frontend, ours) -> None:
    """A stop string ends a request here, which aborts it at the scheduler; the client's next
    turn (same id) must not see the tokens the scheduler made meanwhile, nor its abort output."""
    ids = words(ours["demo"])
    fe = live_frontend()
    sock = fe.client()
    old = submit(fe, sock, "chat", stop=[" two"])
    fe.scheduler_send(fe.first_token(old.request_id, ids[0]))
    fe.scheduler_send(TokenOutputs([], [old.request_id], [ids[1]]))
    msgs = fe.until_final(sock)
    assert msgs[-1]["finish_reason"] == "stop" and msgs[-1]["text"] == " one"
    abort = fe.scheduler_recv()
    assert isinstance(abort, AbortRequests) and abort.request_ids == [old.request_id]
    new = submit(fe, sock, "chat", prompt="Hello there")
    assert new.prompt_token_ids[: len(old.prompt_token_ids) + 2] == old.prompt_token_ids + ids[:2]
    late_outputs_of(fe, old.request_id, stray=ids[2])
    fe.scheduler_send(fe.first_token(new.request_id, ids[5]))
    fe.scheduler_send(TokenOutputs([RequestOutput(new.request_id, [ids[6]], finish_reason="length")]))
    msgs = fe.until_final(sock)
    assert [t for m in msgs[:-1] for t in m["token_ids"]] == ids[5:7]
    assert msgs[-1]["finish_reason"] == "length" and msgs[-1]["token_ids"] == ids[5:7]
    assert msgs[-1]["text"] == " and of" and msgs[-1]["request_id"] == "chat"
    assert new.request_id != old.request_id


def test_late_outputs_do_not_reach_a_reuse_tokenized_in_the_pool(live_frontend, gated, ours) -> None:
    """The reuse's prompt is tokenized in the pool; the old request's late outputs arrive both
    while it tokenizes and after it was admitted."""
    ids = words(ours["demo"])
    fe = live_frontend(gated, tokenize_inline_chars=100)
    sock = fe.client()
    old = submit(fe, sock, "p")
    fe.send(sock, type="abort", request_id="p")
    assert fe.until_final(sock)[-1]["finish_reason"] == "abort"
    assert isinstance(fe.scheduler_recv(), AbortRequests)
    fe.send(sock, type="generate", request_id="p", prompt="word " * 30, max_tokens=10, stream=True)
    assert gated.entered.wait(5)
    fe.scheduler_send(TokenOutputs([], [old.request_id], [ids[0]]))  # while it tokenizes
    assert fe.recv(sock, timeout=0.2) is None
    gated.gate.set()
    new = fe.scheduler_recv()
    assert isinstance(new, AddRequest)
    late_outputs_of(fe, old.request_id, stray=ids[1])  # after it was admitted
    fe.scheduler_send(TokenOutputs([RequestOutput(new.request_id, [ids[2]], finish_reason="length")]))
    msgs = fe.until_final(sock)
    assert [m["type"] for m in msgs] == ["delta", "final"]
    assert msgs[-1]["token_ids"] == ids[2:3] and msgs[-1]["finish_reason"] == "length"
    assert new.request_id != old.request_id


def test_every_submission_has_its_own_scheduler_id_and_the_client_sees_its_own(live_frontend, ours) -> None:
    """Ids at the scheduler never repeat, whatever the client reuses; deltas, finals and error
    finals (a scheduler error included) carry the client's id; an id its client has in flight is
    refused with an error map (not a final: the running request's one final is still to come),
    while another client's use of that id is a request of its own."""
    ids = words(ours["demo"])
    fe = live_frontend()
    a, b = fe.client(), fe.client()
    seen = []
    for turn in range(3):
        add = submit(fe, a, "same")
        seen.append(add.request_id)
        fe.scheduler_send(TokenOutputs([RequestOutput(add.request_id, [ids[turn]], finish_reason="length")]))
        msgs = fe.until_final(a)
        assert [m["request_id"] for m in msgs] == ["same", "same"] and msgs[-1]["token_ids"] == [ids[turn]]
    other = submit(fe, b, "same-too")  # another client's id, while "same" is idle
    seen.append(other.request_id)
    add = submit(fe, a, "same")
    seen.append(add.request_id)
    fe.send(a, type="generate", request_id="same", prompt="Hi", max_tokens=4)  # in flight for a: refused here
    refused = fe.recv(a)
    assert (refused["type"], refused["request_id"], refused["code"]) == ("error", "same", "duplicate_request_id")
    assert "already in flight" in refused["message"]
    assert fe.scheduler_recv(timeout=0.2) is None  # the refused one never reached the scheduler
    b_same = submit(fe, b, "same")  # b's "same" is b's own request, beside a's
    seen.append(b_same.request_id)
    fe.scheduler_send(TokenOutputs([RequestOutput(b_same.request_id, [ids[4]], finish_reason="length")]))
    assert [(m["request_id"], m["token_ids"]) for m in fe.until_final(b)] == [("same", [ids[4]])] * 2
    fe.scheduler_send(
        TokenOutputs([RequestOutput(add.request_id, [], finish_reason="error", error="overloaded: try later")])
    )
    error = fe.until_final(a)[-1]
    assert (error["request_id"], error["finish_reason"], error["error"]) == ("same", "error", "overloaded: try later")
    assert len(set(seen)) == len(seen) == 6
    assert set(fe.frontend.requests) == {other.request_id} and set(fe.frontend.in_flight) == {fe.key(b, "same-too")}
    stats_sock = fe.client()
    fe.send(stats_sock, type="stats")
    query = fe.scheduler_recv()
    fe.scheduler_send(SchedulerStats(query.query_id, 1, 1, 0, 1, 0, 0, 0))
    assert fe.recv(stats_sock)["in_flight"] == 1


def test_disconnect_aborts_by_scheduler_id(live_frontend) -> None:
    fe = live_frontend()
    gone = fe.client()
    adds = [submit(fe, gone, rid) for rid in ("g1", "g2")]
    gone.close(linger=0)
    abort = fe.scheduler_recv()
    assert isinstance(abort, AbortRequests) and sorted(abort.request_ids) == sorted(a.request_id for a in adds)
    assert fe.wait_for(lambda: not fe.frontend.requests and not fe.frontend.in_flight)
