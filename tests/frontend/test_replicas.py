"""Data-parallel routing (frontend/replicas.py): the least loaded replica gets a new request,
a continuation goes back to the replica that holds its KV, aborts go to the owner alone, a
dead replica gets nothing; and the frontend loop with two stand-in schedulers: stats merged
across them, a replica's failure ending its own requests only (conftest.py: ``live_frontend``)."""

from __future__ import annotations

import time

import pytest

from conveyor.frontend.replicas import Gather, ReplicaSet, merge_stats, replica_stats
from conveyor.ipc import codec
from conveyor.ipc.messages import (
    AbortRequests,
    AddRequest,
    ProcessFailed,
    RequestOutput,
    SamplingParams,
    SchedulerStats,
    StatsQuery,
    TokenOutputs,
)


class FakeLink:
    """A scheduler link that keeps what it was sent."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)


def make_set(n: int, max_sessions: int = 16) -> tuple[ReplicaSet, list[FakeLink]]:
    links = [FakeLink() for _ in range(n)]
    return ReplicaSet(links, max_sessions), links


def add(sid: str, num_tokens: int = 4) -> AddRequest:
    return AddRequest(sid, list(range(num_tokens)), SamplingParams(), time.time())


def finished(*sids: str) -> TokenOutputs:
    return TokenOutputs([RequestOutput(sid, [7], finish_reason="length") for sid in sids])


def submit(
    replicas: ReplicaSet, sid: str, session: str | None = None, num_tokens: int = 4, continuing: bool = False
) -> int:
    replica = replicas.submit(add(sid, num_tokens), session or sid, continuing=continuing)
    assert replica is not None
    return replica.index


def test_an_n_request_is_outstanding_until_every_sequence_finished() -> None:
    """Parallel sampling: a request of n = 3 is answered under its sequences' ids; it counts
    at its replica until the third finishes; an abort of one sequence goes to that replica
    and releases nothing (its finish does); an abort of the request releases it at once."""
    replicas, links = make_set(2)
    msg = AddRequest("7", [1, 2, 3], SamplingParams(n=3), time.time())
    assert replicas.submit(msg, "s", continuing=False).index == 0
    replicas.on_outputs(finished("7/0", "7/2"))
    assert replicas.replicas[0].outstanding == 1
    replicas.abort(["7/1"])  # a stop string ended sequence 1
    assert links[0].sent[-1] == AbortRequests(["7/1"]) and replicas.replicas[0].outstanding == 1
    replicas.on_outputs(TokenOutputs([RequestOutput("7/1", [], finish_reason="abort")]))
    assert replicas.replicas[0].outstanding == 0 and replicas.owner("7") is None
    replicas.abort(["7/0"])  # finished there already: nothing is sent
    assert links[0].sent[-1] == AbortRequests(["7/1"])
    # Aborted as a whole: released at once; its sequences' late finishes change nothing.
    assert replicas.submit(AddRequest("8", [1], SamplingParams(n=2), time.time()), "t", continuing=False).index == 1
    replicas.abort(["8"])
    assert links[1].sent[-1] == AbortRequests(["8"]) and replicas.replicas[1].outstanding == 0
    replicas.on_outputs(finished("8/0", "8/1"))
    assert [r.outstanding for r in replicas.replicas] == [0, 0]


def test_a_new_request_goes_to_the_replica_with_the_least_outstanding_work() -> None:
    replicas, links = make_set(3)
    assert [submit(replicas, s) for s in "abc"] == [0, 1, 2]  # idle: one each
    assert [r.outstanding for r in replicas.replicas] == [1, 1, 1]
    replicas.on_outputs(finished("b"))  # replica 1 finished its request: it is the least loaded
    assert [r.outstanding for r in replicas.replicas] == [1, 0, 1]
    assert submit(replicas, "d") == 1
    # As many requests on each: the fewer outstanding prompt tokens win.
    replicas.on_outputs(finished("a", "c", "d"))
    # Idle again: the least recently picked first (0, then 2: 1 took "d" after 2 took "c").
    assert submit(replicas, "long", num_tokens=100) == 0
    assert submit(replicas, "short", num_tokens=5) == 2
    assert submit(replicas, "mid", num_tokens=50) == 1
    # One request on each: the fewest outstanding prompt tokens win (5 at 2, 50 at 1, 100 at 0).
    assert submit(replicas, "fourth", num_tokens=5) == 2
    assert submit(replicas, "fifth", num_tokens=5) == 1  # two at 2, one each at 0 and 1: 50 tokens beat 100
    assert [r.outstanding_prompt_tokens for r in replicas.replicas] == [100, 55, 10]
    # Each AddRequest went to the replica it was routed to, and only there.
    assert [[m.request_id for m in link.sent] for link in links] == [
        ["a", "long"],
        ["b", "d", "mid", "fifth"],
        ["c", "short", "fourth"],
    ]


def test_an_idle_server_deals_requests_round_robin() -> None:
    replicas, _ = make_set(2)
    picks = []
    for i in range(6):
        picks.append(submit(replicas, f"r{i}"))
        replicas.on_outputs(finished(f"r{i}"))  # each finishes before the next arrives
    assert picks == [0, 1, 0, 1, 0, 1]
    assert [r.routed for r in replicas.replicas] == [3, 3] and [r.outstanding for r in replicas.replicas] == [0, 0]


def test_a_continuation_sticks_to_the_replica_of_its_earlier_turn() -> None:
    replicas, links = make_set(2)
    assert submit(replicas, "1", session="conv") == 0
    replicas.on_outputs(finished("1"))
    assert [submit(replicas, sid) for sid in ("2", "3", "4")] == [1, 0, 1]
    replicas.on_outputs(finished("2", "4"))
    assert [r.outstanding for r in replicas.replicas] == [1, 0]
    # "conv"'s next turn goes back to replica 0, which holds its KV, though replica 1 is idle.
    assert submit(replicas, "5", session="conv", continuing=True) == 0
    replicas.on_outputs(finished("5"))
    assert submit(replicas, "6", session="conv", continuing=True) == 0  # and the turn after it
    assert [r.outstanding for r in replicas.replicas] == [2, 0]
    # A request under a remembered session that does not continue it is routed as any new one.
    assert submit(replicas, "7", session="conv", continuing=False) == 1
    assert links[0].sent[-1].request_id == "6" and links[1].sent[-1].request_id == "7"


def test_placements_are_bounded_like_sessions() -> None:
    replicas, _ = make_set(2, max_sessions=2)
    assert submit(replicas, "1", session="old") == 0
    assert submit(replicas, "2", session="b") == 1
    assert submit(replicas, "3", session="c") == 0  # "old" is forgotten: two newer sessions
    assert submit(replicas, "4", session="c", continuing=True) == 0  # sticks, though 0 is the busier
    # "old" would stick to replica 0 too if it were remembered; it is routed as a new request.
    assert submit(replicas, "5", session="old", continuing=True) == 1


def test_aborts_go_to_the_owner_alone_and_release_its_work() -> None:
    replicas, links = make_set(2)
    for sid in "abcd":
        submit(replicas, sid)
    assert [replicas.owner(s).index for s in "abcd"] == [0, 1, 0, 1]
    replicas.on_outputs(finished("c"))  # finished there: an abort of it is dropped
    for link in links:
        link.sent.clear()
    replicas.abort(["a", "b", "c", "d", "never-sent"])
    assert [m.request_ids for m in links[0].sent] == [["a"]]
    assert [m.request_ids for m in links[1].sent] == [["b", "d"]]
    assert all(isinstance(m, AbortRequests) for link in links for m in link.sent)
    assert [r.outstanding for r in replicas.replicas] == [0, 0]
    assert [r.outstanding_prompt_tokens for r in replicas.replicas] == [0, 0]
    assert all(replicas.owner(s) is None for s in "abcd")
    replicas.abort(["a"])  # twice: nothing more is sent
    assert [len(link.sent) for link in links] == [1, 1]


def test_a_dead_replica_is_skipped_and_its_requests_are_handed_back() -> None:
    replicas, links = make_set(3)
    for sid in "abcdef":
        submit(replicas, sid, session=f"s-{sid}")
    assert replicas.owner("b").index == 1 and replicas.owner("e").index == 1
    held = replicas.fail(1, "replica 1 failed: worker.1 process died")
    assert sorted(held) == ["b", "e"]
    assert replicas.replicas[1].outstanding == 0 and not replicas.replicas[1].alive
    assert [r.index for r in replicas.live()] == [0, 2]
    links[1].sent.clear()
    # New requests, and a continuation whose KV died with replica 1, go to the live ones.
    assert submit(replicas, "g") in (0, 2)
    assert submit(replicas, "h", session="s-b", continuing=True) in (0, 2)
    replicas.abort(["b", "e"])  # already failed: nothing goes to the dead replica
    assert replicas.broadcast(StatsQuery("q")) == {0, 2}
    assert links[1].sent == []
    replicas.fail(0, "gone")
    replicas.fail(2, "gone")
    assert replicas.submit(add("last"), "last", continuing=False) is None
    assert replicas.broadcast(StatsQuery("q2")) == set()


def test_gather_completes_when_every_replica_answered_or_died() -> None:
    gather: Gather[str] = Gather({0, 1, 2})
    assert not gather.add(0, "zero")
    assert not gather.add(5, "stranger")  # not asked: ignored
    assert not gather.drop(2)
    assert gather.add(1, "one")
    assert gather.answers == {0: "zero", 1: "one"}


def stats(query_id: str, total: int, free: int, held: int, running: int, rows: list) -> SchedulerStats:
    return SchedulerStats(
        query_id,
        total_blocks=total,
        free_blocks=free,
        held_blocks=held,
        num_running=running,
        num_waiting=1,
        num_steps=len(rows),
        num_preemptions=0,
        prefix_cache_hit_tokens=running * 10,
        iteration_fields=["step", "time"],
        recent_iterations=rows,
        iteration_token_counts=[running, len(rows)],
        iteration_token_sum=running * 100,
    )


def test_stats_are_summed_and_iterations_interleaved_by_time() -> None:
    a = stats("q", 100, 60, 40, 3, [[1, 10.0], [2, 12.0]])
    b = stats("q", 50, 45, 5, 1, [[7, 11.0]])
    merged = merge_stats({0: a, 1: b})
    assert (merged.total_blocks, merged.free_blocks, merged.held_blocks) == (150, 105, 45)
    assert (merged.num_running, merged.num_waiting, merged.num_steps, merged.prefix_cache_hit_tokens) == (4, 2, 3, 40)
    assert merged.iteration_fields == ["step", "time", "replica"]
    assert merged.recent_iterations == [[1, 10.0, 0], [7, 11.0, 1], [2, 12.0, 0]]
    assert (merged.iteration_token_counts, merged.iteration_token_sum) == ([4, 3], 400)  # bucket by bucket
    assert merge_stats({1: b}) is b  # one replica: its stats as they are


def test_replica_entries_name_each_replica_and_a_dead_one_says_why() -> None:
    replicas, _ = make_set(2)
    submit(replicas, "a")
    replicas.fail(1, "replica 1 failed: scheduler.1 process died")
    entries = replica_stats(replicas, {0: stats("q", 100, 60, 40, 3, [[1, 10.0]])})
    assert entries[0]["replica"] == 0 and entries[0]["alive"] and entries[0]["total_blocks"] == 100
    assert entries[0]["in_flight"] == 1 and entries[0]["routed"] == 1 and "iterations" not in entries[0]
    assert entries[1] == {
        "replica": 1,
        "alive": False,
        "routed": 0,
        "in_flight": 0,
        "error": "replica 1 failed: scheduler.1 process died",
    }


# ---------------------------------------------------------------- the frontend with two replicas


class SecondScheduler:
    """A stand-in for replica 1's scheduler, on the frontend's links to it."""

    def __init__(self, fe) -> None:
        addresses = fe.addresses.replica(1)
        self.from_frontend = fe._socket(fe.zmq.PULL, addresses.to_scheduler, bind=True)
        self.to_frontend = fe._socket(fe.zmq.PUSH, addresses.to_frontend, bind=False)

    def recv(self, timeout: float = 5.0):
        if not self.from_frontend.poll(int(timeout * 1000)):
            return None
        return codec.decode(self.from_frontend.recv())

    def send(self, msg) -> None:
        self.to_frontend.send(codec.encode(msg))


@pytest.fixture
def two_replicas(live_frontend):
    fe = live_frontend(data_parallel_size=2)
    return fe, SecondScheduler(fe)


def test_frontend_spreads_requests_and_merges_stats(two_replicas) -> None:
    fe, second = two_replicas
    sock = fe.client()
    for rid in ("a", "b"):
        fe.send(sock, type="generate", request_id=rid, prompt="Say:", max_tokens=10)
    first = fe.scheduler_recv()
    other = second.recv()
    assert isinstance(first, AddRequest) and isinstance(other, AddRequest)
    fe.send(sock, type="stats")
    q0, q1 = fe.scheduler_recv(), second.recv()
    assert isinstance(q0, StatsQuery) and isinstance(q1, StatsQuery) and q0.query_id == q1.query_id
    fe.scheduler_send(stats(q0.query_id, 100, 60, 40, 1, [[1, 10.0]]))
    assert fe.recv(sock, timeout=0.3) is None  # waits for replica 1 too
    second.send(stats(q1.query_id, 100, 90, 10, 1, [[1, 11.0]]))
    reply = fe.recv(sock)
    assert reply["type"] == "stats" and reply["total_blocks"] == 200 and reply["held_blocks"] == 50
    assert reply["num_running"] == 2 and reply["in_flight"] == 2
    assert [(r["replica"], r["alive"], r["in_flight"], r["held_blocks"]) for r in reply["replicas"]] == [
        (0, True, 1, 40),
        (1, True, 1, 10),
    ]


def test_a_replica_failure_ends_only_its_own_requests(two_replicas) -> None:
    fe, second = two_replicas
    sock = fe.client()
    for rid in ("a", "b"):
        fe.send(sock, type="generate", request_id=rid, prompt="Say:", max_tokens=10)
    on_zero, on_one = fe.scheduler_recv(), second.recv()
    assert isinstance(on_zero, AddRequest) and isinstance(on_one, AddRequest)
    fe.send(sock, type="stats")  # in flight when replica 1 dies: answered by replica 0 alone
    query = fe.scheduler_recv()
    assert isinstance(query, StatsQuery) and isinstance(second.recv(), StatsQuery)
    fe.control.send(codec.encode(ProcessFailed("worker.1", "worker.1 process died (exit code -9)")))
    failed = fe.until_final(sock)[-1]
    assert failed["finish_reason"] == "error" and "replica 1 failed" in failed["error"]
    fe.scheduler_send(stats(query.query_id, 100, 60, 40, 1, []))
    reply = fe.recv(sock)
    assert reply["type"] == "stats" and reply["total_blocks"] == 100 and reply["in_flight"] == 1
    assert reply["replicas"][1]["alive"] is False and "worker.1 process died" in reply["replicas"][1]["error"]
    # The request on replica 0 goes on; new requests go to replica 0 only.
    fe.scheduler_send(TokenOutputs([RequestOutput(on_zero.request_id, [5], finish_reason="length")]))
    done = fe.until_final(sock)[-1]
    assert done["finish_reason"] == "length"
    assert {failed["request_id"], done["request_id"]} == {"a", "b"}
    fe.send(sock, type="generate", request_id="c", prompt="Say:", max_tokens=10)
    assert isinstance(fe.scheduler_recv(), AddRequest)
    assert second.recv(timeout=0.3) is None


def test_prometheus_shows_each_replica_beside_the_sums() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from conveyor.frontend.request_metrics import FrontendMetrics
    from conveyor.http import prometheus
    from conveyor.protocol import replies

    replicas, _ = make_set(2)
    for sid in "abc":
        submit(replicas, sid)
    replicas.fail(1, "replica 1 failed: worker.1 process died")
    answers = {0: stats("q", 100, 60, 40, 3, [])}
    reply = replies.stats_reply(merge_stats(answers), 2, iterations=False)
    reply["replicas"] = replica_stats(replicas, answers)
    text = prometheus.exposition(replies.metrics_reply(**FrontendMetrics().snapshot()), reply, "m").decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    m = ("model_name", "m")
    r0, r1 = (m, ("replica", "0")), (m, ("replica", "1"))
    assert (samples[("conveyor:replica_up", r0)], samples[("conveyor:replica_up", r1)]) == (1, 0)
    assert (
        samples[("conveyor:replica_requests_in_flight", r0)],
        samples[("conveyor:replica_requests_in_flight", r1)],
    ) == (2, 0)
    assert (
        samples[("conveyor:replica_requests_routed_total", r0)],
        samples[("conveyor:replica_requests_routed_total", r1)],
    ) == (2, 1)
    assert samples[("conveyor:replica_kv_cache_usage_perc", r0)] == pytest.approx(0.4)
    assert ("conveyor:replica_kv_cache_usage_perc", r1) not in samples  # dead: no pool to show
    assert samples[("conveyor:kv_blocks_used", (m,))] == 40  # the sums, as before
