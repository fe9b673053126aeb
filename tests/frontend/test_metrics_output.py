"""The metrics hooks of the output path and the frontend: the inter-token gaps the output path
collects per handler call equal each stream's gaps observed one token at a time, whatever shape
the outputs come in (first tokens with timing fields, columns, merged steps, a stop string);
and a live frontend (conftest.py: ``live_frontend``) answers the ``metrics`` message with the
tokens, finishes and latencies of the requests it served."""

from __future__ import annotations

import time

import pytest

from conveyor import profiling
from conveyor.frontend import request_metrics as fm
from conveyor.frontend.detokenizer import IncrementalDetokenizer
from conveyor.frontend.output import OutputPath
from conveyor.frontend.request_metrics import FrontendMetrics
from conveyor.frontend.request_state import RequestState
from conveyor.frontend.sessions import Sessions
from conveyor.frontend.stop import StopStringMatcher
from conveyor.ipc.messages import AddRequest, RequestOutput, TokenOutputs
from tests.frontend.test_metrics import per_token_counts

MS = 1_000_000


class FinalsOnly:
    """A stand-in ClientSender for requests that are not streamed: only finals are sent."""

    raw = None  # the socket deltas would go on: none are sent

    def __init__(self, profiler: profiling.Profiler) -> None:
        self.finals: list[dict] = []
        self.timer = profiler.timer("client_send")

    def push_map(self, identity: bytes, obj: dict) -> None:
        self.finals.append(obj)


def test_gaps_of_every_output_shape_count_as_per_token_observation(ours, monkeypatch) -> None:
    """Four streams through the output path under a clock the test sets per handler call: each
    token's gap is the time since its stream's previous output (0 for tokens of one output
    after its first), so the reference is computed per token from the delivery times."""
    tok = ours["demo"]
    profiler = profiling.Profiler("test", enabled=False)
    sender = FinalsOnly(profiler)
    requests: dict[str, RequestState] = {}
    metrics = FrontendMetrics()
    path = OutputPath(
        requests,
        sender,
        Sessions(8),
        profiler,
        untrack=lambda s: requests.pop(s.scheduler_id),
        abort=lambda ids: None,
        metrics=metrics,
    )
    t = tok.encode(" the", add_special_tokens=False)[0]
    word = tok.encode(" lighthouse", add_special_tokens=False)  # several tokens
    prompt = tok.encode("Say:")
    for rid, stop in (("a", []), ("b", []), ("c", ["lighthouse"]), ("d", [])):
        requests[rid] = RequestState(
            request_id=rid,
            identity=b"x",
            stream=False,
            prompt_len=len(prompt),
            arrival_time=time.time(),
            detokenizer=IncrementalDetokenizer(tok, prompt),
            stop=StopStringMatcher(stop),
            prompt_ids=list(prompt),
        )
    states = dict(requests)  # still readable after they end
    clock = {"now": 0}
    monkeypatch.setattr(profiling, "now_ns", lambda: clock["now"])
    deliveries: dict[str, list[int]] = {rid: [] for rid in requests}  # per token, when it was handed out

    def call(at_ms: int, *steps: TokenOutputs) -> None:
        clock["now"] = at_ms * MS
        before = {rid: len(state.token_ids) for rid, state in states.items()}
        path.on_token_outputs(list(steps))
        for rid, state in states.items():
            deliveries[rid] += [clock["now"]] * (len(state.token_ids) - before[rid])

    call(10, TokenOutputs([RequestOutput(r, [t], scheduled_time=0.0, first_token_time=0.0) for r in "abc"]))
    call(13, TokenOutputs([], ["a", "b", "c"], [t, t, t]))
    call(15, TokenOutputs([RequestOutput("d", [t, t], scheduled_time=0.0, first_token_time=0.0)], ["a"], [t]))
    call(45, TokenOutputs([], ["a", "b", "d"], [t, t, t]), TokenOutputs([], ["a", "d"], [t, t]))  # merged steps
    call(46, TokenOutputs([RequestOutput("c", list(word) + [t])]))  # a stop string ends c within its tokens
    call(1046, TokenOutputs([RequestOutput(r, [t], finish_reason="length") for r in "abd"]))
    assert not requests and len(sender.finals) == 4

    gaps = []
    for times in deliveries.values():
        gaps += [later - earlier for earlier, later in zip(times, times[1:])]
    metrics.flush()
    assert metrics.itl.counts == per_token_counts(fm.TOKEN_GAP_BUCKETS_S, gaps)
    assert metrics.itl.count == len(gaps) and metrics.itl.sum == pytest.approx(sum(gaps) / 1e9)
    completion = sum(final["usage"]["completion_tokens"] for final in sender.finals)
    assert metrics.generation_tokens == completion == sum(map(len, deliveries.values()))
    assert metrics.finished == {"stop": 1, "length": 3, "abort": 0, "error": 0}
    assert metrics.ttft.count == metrics.e2e.count == metrics.queue.count == 4


def test_a_live_frontend_answers_metrics(live_frontend) -> None:
    fe = live_frontend()
    done, gone = fe.client(), fe.client()
    fe.send(done, type="generate", request_id="r", prompt="Say:", stream=True, max_tokens=4)
    add = fe.scheduler_recv()
    assert isinstance(add, AddRequest)
    sid, prompt_len = add.request_id, len(add.prompt_token_ids)
    fe.scheduler_send(fe.first_token(sid, 5))
    fe.scheduler_send(TokenOutputs([], [sid], [6]))
    fe.scheduler_send(TokenOutputs([RequestOutput(sid, [7, 8], finish_reason="length")]))
    final = fe.until_final(done)[-1]
    assert final["usage"]["completion_tokens"] == 4

    fe.send(gone, type="generate", request_id="g", prompt="Hello there", stream=True, max_tokens=4)
    gone_add = fe.scheduler_recv()
    fe.scheduler_send(fe.first_token(gone_add.request_id, 5))
    assert fe.recv(gone)["type"] == "delta"
    gone.close(linger=0)  # a client that disconnects: its request counts as aborted
    assert fe.wait_for(lambda: not fe.frontend.in_flight)

    asker = fe.client()
    fe.send(asker, type="metrics")
    reply = fe.recv(asker)
    assert (reply["type"], reply["v"]) == ("metrics", 1)
    assert reply["counters"] == {
        "prompt_tokens": prompt_len + len(gone_add.prompt_token_ids),
        "generation_tokens": 5,
        "request_success": {"stop": 0, "length": 1, "abort": 1, "error": 0},
        "clients_not_reading": 0,  # the gone client disconnected: it was not dropped for not reading
    }
    hists = reply["histograms"]
    assert hists["inter_token_latency_seconds"]["count"] == 3  # r's 4 tokens (the last two together)
    assert hists["inter_token_latency_seconds"]["counts"][0] >= 1  # the gap of 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds"):
        assert hists[name]["count"] == 1, name  # the gone client's request has no final, so no latencies
    fe.send(asker, type="metrics", extra=1)
    error = fe.recv(asker)
    assert error["type"] == "error" and "unknown field" in error["message"]
