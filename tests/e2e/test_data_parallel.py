"""bin/serve --data-parallel-size 2 end to end (frontend/replicas.py): load spreads over the
replicas, a continuation goes back to the replica holding its KV, ``stats`` adds the replicas
up and shows each, and a replica whose worker dies fails only its own requests while the
server serves on with the other (``--serve-on-replica-death``, the default).

One server for the module (a start costs seconds): the tests run in file order and the last
one kills replica 1; the fixture's teardown checks that no process outlives the server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from conveyor.client import AsyncClient
from tests.e2e.serve_harness import ServeProcess, alive

SERVE_ARGS = ("--model", "demo", "--data-parallel-size", "2", "--num-kv-blocks", "64", "--threads", "1")
GREEDY = dict(temperature=0, ignore_eos=True)
# Fields of ``stats`` that are per-replica quantities: the server's is the sum of its replicas'.
SUMMED = ("total_blocks", "free_blocks", "held_blocks", "cached_blocks", "num_steps", "prefix_cache_queried_tokens")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = ServeProcess(list(SERVE_ARGS), tmp_path_factory.mktemp("dp"))
    pids = [*served.pids.values(), served._pid_of("worker.1"), served._pid_of("scheduler.1")]
    yield served
    served.shut_down(pids)


def eventually(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def replica_field(stats: dict, name: str) -> list:
    return [replica.get(name) for replica in stats["replicas"]]


def test_load_spreads_over_the_replicas_and_stats_add_up(server) -> None:
    prompt = list(range(10, 29))

    async def run():
        async with AsyncClient(server.address, timeout=60) as client:
            results = await asyncio.gather(
                *(client.generate(token_ids=[100 + i, *prompt], max_tokens=4, **GREEDY) for i in range(32))
            )
            return results, await client.stats(iterations=True)

    results, stats = asyncio.run(run())
    assert [r.finish_reason for r in results] == ["length"] * 32
    assert replica_field(stats, "replica") == [0, 1] and replica_field(stats, "alive") == [True, True]
    routed = replica_field(stats, "routed")
    assert sum(routed) == 32 and min(routed) >= 32 / 3, routed
    # Each replica's scheduler saw the requests routed to it (19 prompt tokens looked up in the
    # prefix cache per admission: all but the last, which always runs).
    assert replica_field(stats, "prefix_cache_queried_tokens") == [19 * n for n in routed]
    for name in SUMMED:
        assert stats[name] == sum(replica_field(stats, name)), name
    assert stats["total_blocks"] == 2 * 64 and stats["held_blocks"] == 0  # every block came back
    assert replica_field(stats, "in_flight") == [0, 0] and stats["in_flight"] == 0
    rows = stats["iterations"]  # both replicas' steps, each tagged with its replica
    assert {row["replica"] for row in rows} == {0, 1}
    assert len(rows) == stats["num_steps"] and [r["time"] for r in rows] == sorted(r["time"] for r in rows)


def test_a_continuation_after_an_abort_stays_on_the_replica_that_holds_its_kv(server) -> None:
    prompt = [300 + i for i in range(40)]  # two full blocks of 16, shared with nothing else

    async def run():
        async with AsyncClient(server.address, timeout=60) as client:
            before = await client.stats()
            async for delta in client.stream(token_ids=prompt, max_tokens=200, request_id="conv", **GREEDY):
                if delta.token_ids and delta.finish_reason is None:
                    await client.abort("conv")
                if delta.finish_reason is not None:
                    first = delta
            middle = await client.stats()
            second = await client.generate(token_ids=[5, 6], max_tokens=3, request_id="conv", **GREEDY)
            return before, first, middle, second, await client.stats()

    before, first, middle, second, after = asyncio.run(run())
    assert first.finish_reason == "abort"

    def moved(later: dict, earlier: dict, name: str) -> list[int]:
        return [a - b for a, b in zip(replica_field(later, name), replica_field(earlier, name))]

    queried = moved(middle, before, "prefix_cache_queried_tokens")
    owner = 0 if queried[0] else 1
    assert queried[owner] == len(prompt) - 1 and queried[1 - owner] == 0
    # Round robin would send the next new request to the other replica (the owner was picked
    # last); the continuation went back to the owner, whose prefix cache had the context.
    assert second.finish_reason == "length" and second.usage.cached_tokens >= 32
    hits = moved(after, middle, "prefix_cache_hit_tokens")
    assert hits[owner] == second.usage.cached_tokens and hits[1 - owner] == 0
    assert moved(after, middle, "prefix_cache_queried_tokens")[1 - owner] == 0  # the other saw nothing


def test_a_dead_replica_fails_only_its_own_requests_and_the_server_serves_on(server) -> None:
    worker1, scheduler1 = server._pid_of("worker.1"), server._pid_of("scheduler.1")

    async def run():
        async with AsyncClient(server.address, timeout=60) as client:
            started = [asyncio.Event() for _ in range(8)]

            async def one(i: int):
                async for delta in client.stream(token_ids=[400 + i, 11, 12], max_tokens=60, **GREEDY):
                    started[i].set()
                    if delta.finish_reason is not None:
                        return delta.result

            tasks = [asyncio.ensure_future(one(i)) for i in range(8)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
            held = replica_field(await client.stats(), "in_flight")
            os.kill(worker1, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)  # no request hangs
            after = await client.stats()
            fresh = await asyncio.gather(
                *(client.generate(token_ids=[500 + i, 11], max_tokens=3, **GREEDY) for i in range(4))
            )
            return held, results, after, fresh, await client.stats()

    held, results, after, fresh, final = asyncio.run(run())
    assert held == [4, 4]
    failed = [r for r in results if r.finish_reason == "error"]
    assert len(failed) == held[1] and all("replica 1 failed" in r.error for r in failed)
    assert [r.finish_reason for r in results if r not in failed] == ["length"] * held[0]
    assert all(len(r.token_ids) == 60 for r in results if r not in failed)
    # The server serves on with replica 0 alone: replica 1's scheduler is stopped, new requests
    # all go to replica 0, and its blocks all come back.
    assert server.proc.poll() is None and not alive(worker1)
    assert eventually(lambda: not alive(scheduler1))
    assert replica_field(after, "alive") == [True, False] and "worker.1" in after["replicas"][1]["error"]
    assert after["total_blocks"] == 64  # the server's pool is replica 0's now
    assert [r.finish_reason for r in fresh] == ["length"] * 4
    assert replica_field(final, "routed")[1] == replica_field(after, "routed")[1]
    assert final["held_blocks"] == 0 and final["replicas"][0]["held_blocks"] == 0
    assert eventually(
        lambda: "stopping replica 1, serving on the others" in server.output()
    )  # stderr is pumped by a thread


def test_serve_on_replica_death_decides_whether_one_death_stops_the_server(tmp_path) -> None:
    """The supervision rule alone (no process started): a replica's death stops the server
    only with --no-serve-on-replica-death or when it was the last replica; the frontend's
    or HTTP process's death always does."""
    from conveyor.assembly.supervisor import Server
    from conveyor.cli.serve import build_parser, server_config

    def server_with(*flags: str) -> Server:
        args = build_parser().parse_args(["--model", "demo", "--host", f"ipc://{tmp_path}/c", *flags])
        run_dir = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        run_dir.mkdir()
        return Server(server_config(args, str(run_dir)))

    servers = []
    try:
        one = server_with()
        two = server_with("--data-parallel-size", "2")
        strict = server_with("--data-parallel-size", "2", "--no-serve-on-replica-death")
        servers += [one, two, strict]
        assert not one._serves_on_without(0)
        assert two._serves_on_without(0) and two._serves_on_without(1)
        two.dead_replicas.add(1)
        assert not two._serves_on_without(0)  # the last one
        assert not strict._serves_on_without(0) and not strict._serves_on_without(1)
    finally:
        for s in servers:
            s.control.close(linger=0)
            s.frontend_control.close(linger=0)
            s.ctx.term()


def test_data_parallel_size_must_be_positive(capsys) -> None:
    from conveyor.cli.serve import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--data-parallel-size", "0"])
    assert "must be >= 1" in capsys.readouterr().err


def test_a_single_replica_keeps_the_plain_names_and_addresses(tmp_path) -> None:
    from conveyor.cli.serve import build_parser, server_config
    from conveyor.runtime.config import replica_of_process, replica_process_name

    args = build_parser().parse_args(["--model", "demo", "--host", f"ipc://{tmp_path}/c", "--data-parallel-size", "3"])
    config = server_config(args, str(tmp_path))
    assert config.replica(0) is config and config.frontend.data_parallel_size == 3
    replicas = [config.replica(i) for i in range(3)]
    internal = [
        (a.to_scheduler, a.to_frontend, c.plans.zmq_address, c.plans.ring_path, c.results.ring_path)
        for a, c in ((r.addresses, r.channels) for r in replicas)
    ]
    assert len({part for parts in internal for part in parts}) == 15  # nothing shared between replicas
    for r in replicas:
        assert (r.addresses.client, r.addresses.control, r.addresses.frontend_control) == (
            config.addresses.client,
            config.addresses.control,
            config.addresses.frontend_control,
        )
        assert r.worker.channels == r.scheduler.channels == r.channels
        assert r.worker.addresses == r.scheduler.addresses == r.addresses
    assert [replica_process_name("worker", i) for i in range(3)] == ["worker", "worker.1", "worker.2"]
    assert [replica_of_process(n) for n in ("scheduler", "scheduler.2", "worker.1-rank1", "frontend", "http")] == [
        0,
        2,
        1,
        None,
        None,
    ]
