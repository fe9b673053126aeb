"""load_lora / unload_lora at the frontend (frontend/relays.py) with stand-in
schedulers that answer late or never: the client gets a ``timeout`` error naming the silent
replicas within the bound, a load taken by some replicas is undone there (and on a silent one
when its late success arrives), the name is fenced until every replica answered, and a
shutdown answers every query still waiting. The bound is shortened here (monkeypatch)."""

from __future__ import annotations

import time

import pytest

from conveyor.frontend import relays
from conveyor.ipc import codec
from conveyor.ipc.messages import LoadLora, LoraUpdated, ProcessFailed, ProfileQuery, StatsQuery, UnloadLora
from tests.frontend.test_replicas import SecondScheduler

BOUND_S = 0.4


@pytest.fixture
def short_bound(monkeypatch) -> None:
    monkeypatch.setattr(relays, "LORA_UPDATE_TIMEOUT_S", BOUND_S)


def load(fe, sock, rid: str, name: str = "sql") -> None:
    fe.send(sock, type="load_lora", request_id=rid, lora_name=name, lora_path="/adapters/sql")


def timed_reply(fe, sock) -> tuple[dict, float]:
    start = time.monotonic()
    reply = fe.recv(sock, timeout=BOUND_S + 5)
    assert reply is not None, "the client was left waiting"
    return reply, time.monotonic() - start


def timed_out_load(live_frontend):
    """Two replicas; a load replica 0 takes and replica 1 never answers: (frontend, replica 1's
    stand-in, client, the LoadLora each got, the client's reply, how long it waited)."""
    fe = live_frontend(data_parallel_size=2, enable_lora_loading=True)
    second = SecondScheduler(fe)
    sock = fe.client()
    load(fe, sock, "l1")
    asked0, asked1 = fe.scheduler_recv(), second.recv()
    assert isinstance(asked0, LoadLora) and isinstance(asked1, LoadLora) and asked0.query_id == asked1.query_id
    fe.scheduler_send(LoraUpdated(asked0.query_id, "sql"))
    return fe, second, sock, asked0, asked1, *timed_reply(fe, sock)


def test_a_load_one_replica_never_answers_times_out_and_converges(live_frontend, short_bound) -> None:
    fe, second, sock, asked0, asked1, reply, waited = timed_out_load(live_frontend)
    assert reply["type"] == "error" and reply["code"] == "timeout" and reply["request_id"] == "l1", reply
    assert "replica(s) [1] did not answer the load of LoRA adapter 'sql'" in reply["message"]
    assert "undone on replica(s) [0]" in reply["message"] and waited < BOUND_S + 1.0
    undo = fe.scheduler_recv()
    assert isinstance(undo, UnloadLora) and undo.name == "sql"
    assert fe.frontend.relays.lora_waiters == {} and set(fe.frontend.relays.lora_owed) == {asked0.query_id}

    # Fenced while replica 1 owes its answer: a retry would race the late one.
    load(fe, sock, "l2")
    fenced = fe.recv(sock)
    assert fenced["code"] == "lora_update_pending" and "replica(s) [1]" in fenced["message"], fenced
    assert second.recv(timeout=0.2) is None

    # The late success is undone there too; the undo's own answer is nobody's.
    second.send(LoraUpdated(asked1.query_id, "sql"))
    late_undo = second.recv()
    assert isinstance(late_undo, UnloadLora) and late_undo.name == "sql"
    assert fe.wait_for(lambda: fe.frontend.relays.lora_owed == {})
    fe.scheduler_send(LoraUpdated(undo.query_id, "sql"))
    second.send(LoraUpdated(late_undo.query_id, "sql"))
    second.send(LoraUpdated(asked1.query_id, "sql"))  # a duplicate: ignored
    assert fe.recv(sock, timeout=0.2) is None

    # The retry goes through on both.
    load(fe, sock, "l3")
    retry0, retry1 = fe.scheduler_recv(), second.recv()
    assert isinstance(retry0, LoadLora) and isinstance(retry1, LoadLora)
    fe.scheduler_send(LoraUpdated(retry0.query_id, "sql"))
    second.send(LoraUpdated(retry1.query_id, "sql"))
    assert fe.recv(sock) == {"type": "lora", "v": 1, "request_id": "l3", "lora_name": "sql", "loaded": True}
    assert fe.frontend.relays.lora_waiters == {} and fe.frontend.relays.lora_owed == {}


def test_an_unanswered_unload_times_out_and_its_late_answer_changes_nothing(live_frontend, short_bound) -> None:
    fe = live_frontend(enable_lora_loading=True)
    sock = fe.client()
    fe.send(sock, type="unload_lora", request_id="u1", lora_name="sql")
    asked = fe.scheduler_recv()
    assert isinstance(asked, UnloadLora)
    reply, waited = timed_reply(fe, sock)
    assert reply["code"] == "timeout" and waited < BOUND_S + 1.0, reply
    assert reply["message"] == f"the scheduler did not answer the unload of LoRA adapter 'sql' within {BOUND_S:g} s"
    fe.scheduler_send(LoraUpdated(asked.query_id, "sql"))
    assert fe.wait_for(lambda: fe.frontend.relays.lora_owed == {})
    assert fe.scheduler_recv(timeout=0.2) is None and fe.recv(sock, timeout=0.2) is None


def test_an_update_waits_for_no_other_of_its_name(live_frontend) -> None:
    """Two updates of one name in flight: the second is refused at once; another name is not."""
    fe = live_frontend(enable_lora_loading=True)
    sock = fe.client()
    load(fe, sock, "a")
    first = fe.scheduler_recv()
    fe.send(sock, type="unload_lora", request_id="b", lora_name="sql")
    refused = fe.recv(sock)
    assert refused["request_id"] == "b" and refused["code"] == "lora_update_pending", refused
    load(fe, sock, "c", name="chat")
    other = fe.scheduler_recv()
    assert isinstance(other, LoadLora) and other.name == "chat"
    fe.scheduler_send(LoraUpdated(first.query_id, "sql"))
    assert fe.recv(sock)["request_id"] == "a"


def test_a_replica_death_releases_what_it_owed(live_frontend, short_bound) -> None:
    fe, _, sock, *_, reply, _ = timed_out_load(live_frontend)
    assert reply["code"] == "timeout"
    assert isinstance(fe.scheduler_recv(), UnloadLora)
    fe.control.send(codec.encode(ProcessFailed("scheduler.1", "scheduler.1 process died")))
    assert fe.wait_for(lambda: fe.frontend.relays.lora_owed == {})
    load(fe, sock, "l2")
    assert isinstance(fe.scheduler_recv(), LoadLora)


def test_shutdown_answers_every_waiting_query(live_frontend) -> None:
    fe = live_frontend(enable_lora_loading=True)
    sock = fe.client()
    load(fe, sock, "l1")
    fe.send(sock, type="stats")
    fe.send(sock, type="profile", window_s=1.0)
    asked = [fe.scheduler_recv() for _ in range(3)]
    assert [type(m) for m in asked] == [LoadLora, StatsQuery, ProfileQuery]
    fe.shutdown()
    replies = [fe.recv(sock) for _ in range(3)]
    assert None not in replies, replies
    by_kind = {(r["type"], r.get("request_id")): r for r in replies}
    assert by_kind[("error", "l1")]["code"] == "server_error" and by_kind[("error", "l1")]["message"] == "test over"
    assert by_kind[("error", None)]["code"] == "server_error" and by_kind[("error", None)]["message"] == "test over"
    assert by_kind[("error", None)]["command"] == "stats"  # the client routes it to the stats call
    assert next(r for r in replies if r["type"] == "profile")["error"] == "test over"
