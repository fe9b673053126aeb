"""The streaming hot path of frontend/output.py (``OutputPath``, a step's columns): what each client
receives, delta by delta, is what the reference path gives (the window decode of
``IncrementalDetokenizer(fast_paths=False)``, the stop-string matcher, one packed map per
delta); stop strings, non-streamed requests, gone clients and the sampled profile timers
work as before. A live frontend loop runs on a thread against a stand-in scheduler
(conftest.py: ``live_frontend``)."""

from __future__ import annotations

import time

from conveyor.frontend.detokenizer import IncrementalDetokenizer
from conveyor.frontend.output import PROFILE_SAMPLE_EVERY
from conveyor.frontend.stop import StopStringMatcher
from conveyor.ipc.messages import AbortRequests, AddRequest, RequestOutput, TokenOutputs

TEXT = "Café déjà vu — naïve Straße! 😀 你好世界 👨‍👩‍👧 🇫🇷 日本語. The lighthouse keeper wrote in his log."


def admit(fe, sock, rid: str, **fields) -> AddRequest:
    """Submit ``rid``; the AddRequest the scheduler got (its ``request_id`` is the scheduler's id)."""
    fe.send(sock, type="generate", request_id=rid, prompt="Say:", max_tokens=1000, **fields)
    add = fe.scheduler_recv()
    assert isinstance(add, AddRequest) and add.request_id != rid
    return add


def test_every_delta_is_what_the_window_decode_gives(live_frontend, ours) -> None:
    """Four streams step by step, through the columns (the hot path): a plain one, one with stop
    strings (one never matches, one spans tokens), one not streamed, one whose text is mostly
    characters split over several tokens. Each delta equals the reference path's, step by step."""
    tok = ours["demo"]
    fe = live_frontend()
    text_ids = tok.encode(TEXT * 2, add_special_tokens=False)
    assert any(tok.stream_piece(t) is None for t in text_ids)  # some tokens are partial characters
    stop_at = TEXT.index("keeper")
    specs = {
        "plain": dict(stream=True),
        "stops": dict(stream=True, stop=["never there", "keeper wrote"]),
        "quiet": dict(stream=False),
        "split": dict(stream=True),
    }
    socks, refs, starts = {}, {}, {"plain": 0, "stops": 0, "quiet": 3, "split": 17}
    sid = {}  # client id -> id at the scheduler
    for rid, fields in specs.items():
        socks[rid] = fe.client()
        add = admit(fe, socks[rid], rid, **fields)
        sid[rid] = add.request_id
        refs[rid] = (
            IncrementalDetokenizer(tok, add.prompt_token_ids, fast_paths=False),
            StopStringMatcher(fields.get("stop", [])),
        )
    streams = [rid for rid in specs if specs[rid]["stream"]]
    live = set(specs)
    expected: dict[str, list[tuple[str, list[int]]]] = {rid: [] for rid in specs}
    sent: dict[str, list[int]] = {rid: [] for rid in specs}
    stopped_at = None
    for step in range(len(text_ids) - 20):
        rids = sorted(live)
        tokens = [text_ids[(starts[rid] + step) % len(text_ids)] for rid in rids]
        if step == 0:  # first tokens come as outputs, then the columns
            now = time.time()
            first = [RequestOutput(sid[r], [t], scheduled_time=now, first_token_time=now) for r, t in zip(rids, tokens)]
            fe.scheduler_send(TokenOutputs(first))
        else:
            fe.scheduler_send(TokenOutputs([], [sid[r] for r in rids], tokens))
        for rid, token in zip(rids, tokens):
            detok, stop = refs[rid]
            sent[rid].append(token)
            text, stopped = stop.feed(detok.push([token]))
            expected[rid].append((text, [token]))
            if stopped:
                live.discard(rid)
                stopped_at = step
        for rid in streams:  # one delta per step and stream (the frontend keeps up: no merging)
            if rid in live or stopped_at == step and rid == "stops":
                msg = fe.recv(socks[rid])
                assert msg["type"] == "delta", (rid, step, msg)
                assert (msg["text"], msg["token_ids"]) == expected[rid][step], (rid, step)
        if stopped_at == step:
            final = fe.recv(socks["stops"])
            assert final["type"] == "final" and final["finish_reason"] == "stop"
            assert final["text"] == TEXT[:stop_at] and final["token_ids"] == sent["stops"]
            abort = fe.scheduler_recv()
            assert isinstance(abort, AbortRequests) and abort.request_ids == [sid["stops"]]
    assert stopped_at is not None
    rids = sorted(live)
    fe.scheduler_send(TokenOutputs([RequestOutput(sid[r], [text_ids[0]], finish_reason="length") for r in rids]))
    for rid in rids:
        detok, stop = refs[rid]
        sent[rid].append(text_ids[0])
        text, _ = stop.feed(detok.push([text_ids[0]]))
        tail, _ = stop.feed(detok.flush())
        text += tail + stop.flush()
        expected[rid].append((text, [text_ids[0]]))
        msgs = []
        while (msg := fe.recv(socks[rid])) is not None:
            msgs.append(msg)
            if msg["type"] == "final":
                break
        if rid == "quiet":
            assert [m["type"] for m in msgs] == ["final"]
        else:
            assert msgs[0]["type"] == "delta" and (msgs[0]["text"], msgs[0]["token_ids"]) == expected[rid][-1]
        final = msgs[-1]
        assert final["finish_reason"] == "length" and final["token_ids"] == sent[rid]
        assert final["text"] == "".join(text for text, _ in expected[rid]) == detok.text


def test_a_client_gone_mid_step_leaves_the_other_streams_flowing(live_frontend, ours) -> None:
    tok = ours["demo"]
    words = tok.encode(" one two three four five", add_special_tokens=False)
    fe = live_frontend()
    stays, goes = fe.client(), fe.client()
    sid = {rid: admit(fe, sock, rid, stream=True).request_id for rid, sock in (("stays", stays), ("goes", goes))}
    now = time.time()
    first = [RequestOutput(sid[r], [words[0]], scheduled_time=now, first_token_time=now) for r in ("goes", "stays")]
    fe.scheduler_send(TokenOutputs(first))
    assert fe.recv(stays)["token_ids"] == words[:1] and fe.recv(goes)["token_ids"] == words[:1]
    goes.close(linger=0)
    aborted = False
    for token in words[1:]:
        fe.scheduler_send(TokenOutputs([], [sid["goes"], sid["stays"]], [token, token]))
        assert fe.recv(stays)["token_ids"] == [token]
    while (msg := fe.scheduler_recv(timeout=2)) is not None:  # by the disconnect event or the failed send
        aborted = aborted or isinstance(msg, AbortRequests) and msg.request_ids == [sid["goes"]]
    assert aborted
    stays_key = fe.key(stays, "stays")
    assert fe.wait_for(
        lambda: set(fe.frontend.in_flight) == {stays_key} and set(fe.frontend.requests) == {sid["stays"]}
    )


def test_profile_timers_sample_the_hot_path(live_frontend, ours) -> None:
    """detokenize, client_send and request_itl are taken for one stream in PROFILE_SAMPLE_EVERY."""
    tok = ours["demo"]
    words = tok.encode(" one two three four five six seven eight", add_special_tokens=False)
    fe = live_frontend()
    socks = [fe.client() for _ in range(4)]
    rids = [admit(fe, sock, f"r{i}", stream=True).request_id for i, sock in enumerate(socks)]
    fe.scheduler_send(TokenOutputs([RequestOutput(r, [words[0]], first_token_time=time.time()) for r in rids]))
    steps = PROFILE_SAMPLE_EVERY  # 4 streams x 16 steps: 64 column tokens, 4 of them timed
    for step in range(steps + 1):
        for sock in socks:
            assert fe.recv(sock) is not None
        if step < steps:
            fe.scheduler_send(TokenOutputs([], rids, [words[1 + step % (len(words) - 1)]] * len(rids)))
    metrics = {m.name: m for m in fe.frontend.profiler.snapshot(60).metrics}
    assert metrics["detokenize"].count == 4 + 4  # first tokens (outputs path: every one) + sampled columns
    assert metrics["client_send"].count >= 1 and metrics["request_itl"].count == 4
    assert all(metrics[name].max >= 0 for name in ("detokenize", "client_send", "request_itl"))
