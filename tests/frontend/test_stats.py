"""The frontend's ``stats`` relay: the scheduler's summary with the frontend's requests in
flight, and the iteration log only for a client that asks for it (conftest.py: ``live_frontend``)."""

from __future__ import annotations

from conveyor.ipc.messages import SchedulerStats, StatsQuery


def test_stats_carries_the_iteration_log_only_when_asked(live_frontend) -> None:
    fe = live_frontend()
    plain, full = fe.client(), fe.client()
    fe.send(plain, type="stats")
    fe.send(full, type="stats", iterations=True)
    for _ in range(2):
        query = fe.scheduler_recv()
        assert isinstance(query, StatsQuery)
        fe.scheduler_send(
            SchedulerStats(query.query_id, 8, 5, 3, 1, 2, 10, 0, iteration_fields=["step"], recent_iterations=[[9]])
        )
    summary, with_log = fe.recv(plain), fe.recv(full)
    assert (summary["type"], summary["v"], summary["total_blocks"], summary["in_flight"]) == ("stats", 1, 8, 0)
    assert "iterations" not in summary and "recent_iterations" not in summary and "query_id" not in summary
    assert with_log["iterations"] == [{"step": 9}]
    assert {k: v for k, v in with_log.items() if k != "iterations"} == summary
    bad = fe.client()
    fe.send(bad, type="stats", iterations="yes")
    error = fe.recv(bad)
    assert error["type"] == "error" and "'iterations'" in error["message"]
