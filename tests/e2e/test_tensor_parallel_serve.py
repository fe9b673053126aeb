"""bin/serve with ``--tensor-parallel-size 2`` on CPU (two worker ranks on gloo), end to end.

Greedy tokens through the two-rank server equal HF transformers' (which the one-rank server
is held to by tests/e2e/test_serve.py, so they equal TP=1's too) under a KV pool small enough
to preempt, by swapping (plan rings, shared memory) and by recomputing (ZeroMQ plan sockets,
one PUSH/PULL pair per rank; pipelined worker steps), and with a shared prompt prefix reused
from the cache. Killing
rank 1 with requests in flight fails every one of them with an error within seconds, stops the
server and leaves no process and no ring file behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch

from conveyor.client import AsyncClient, Client
from conveyor.ipc import shm_ring
from tests.e2e.serve_harness import alive, kill_during_streams, mapped_ring_files, still_alive_after
from tests.e2e.test_serve import wait_for_free_blocks

# 40 blocks of 8 tokens for 12 concurrent requests of up to ~70 tokens: preemption happens.
TP_ARGS = ("--tensor-parallel-size", "2", "--num-kv-blocks", "40", "--block-size", "8", "--threads", "1")
TP_ARGS += ("--max-num-batched-tokens", "64", "--distributed-timeout", "30")
N = 12
SYSTEM = [(13 * i) % 200 + 10 for i in range(16)]  # two full blocks of 8


def prompt(i: int) -> list[int]:
    return [(11 * i + 3 * j) % 190 + 10 for j in range(4 + (i * 7) % 30)]


def max_tokens(i: int) -> int:
    return 10 + (i * 5) % 31


def generate_all(address: str) -> list[list[int]]:
    """The N requests at once (so the pool runs out and requests are preempted), greedy."""

    async def main():
        async with AsyncClient(address, timeout=300) as client:
            jobs = [
                client.generate(token_ids=prompt(i), max_tokens=max_tokens(i), temperature=0, ignore_eos=True)
                for i in range(N)
            ]
            return [r.token_ids for r in await asyncio.gather(*jobs)]

    return asyncio.run(main())


def test_two_ranks_match_hf_with_swap_and_prefix_reuse_then_a_killed_rank_stops_the_server(
    serve_factory, tiny_checkpoint, hf_greedy
) -> None:
    server = serve_factory(
        "--model",
        str(tiny_checkpoint),
        *TP_ARGS,
        "--preemption",
        "swap",
        "--num-cpu-blocks",
        "64",
        "--plan-transport",
        "shm",
    )
    rank1 = server._pid_of("worker-rank1")
    ranks = [server.pids["worker"], rank1]
    assert "with 40 KV blocks" in server.output()  # the pool the ranks agreed on, as asked
    rings = mapped_ring_files(server.pids["worker"])
    assert len(rings) == 2 and mapped_ring_files(rank1) <= rings  # rank 1 reads the same plan ring

    outputs = generate_all(server.address)
    for i in range(N):
        assert outputs[i] == hf_greedy(prompt(i), max_tokens(i)), i
    greedy = dict(temperature=0, ignore_eos=True)
    with Client(server.address, timeout=60) as client:
        stats = wait_for_free_blocks(client)
        assert stats["held_blocks"] == 0, stats
        assert stats["num_preemptions_swap"] > 0 and stats["num_swapped_in_blocks"] > 0, stats
        first = client.generate(token_ids=SYSTEM + [3, 4, 5], max_tokens=6, **greedy)
        second = client.generate(token_ids=SYSTEM + [7, 8], max_tokens=6, **greedy)
        assert first.usage.cached_tokens == 0 and second.usage.cached_tokens == len(SYSTEM)  # reused on both ranks
        assert first.token_ids == hf_greedy(SYSTEM + [3, 4, 5], 6)
        assert second.token_ids == hf_greedy(SYSTEM + [7, 8], 6)

    outcomes = asyncio.run(kill_during_streams(server.address, rank1, num_requests=3, max_tokens=200, timeout=30))
    for d, _ in outcomes:
        assert not isinstance(d, Exception), d
        assert d.finish_reason == "error" and "worker-rank1 process died" in d.result.error, d
    failed_after = max(seconds for _, seconds in outcomes)
    assert failed_after < 10, failed_after  # the process watch, not a collective's 30 s timeout
    assert server.proc.wait(15) != 0
    assert not still_alive_after([*server.pids.values(), rank1], 5)
    bells = [shm_ring.bell_path(path, r) for path in rings for r in range(2)]
    assert not [path for path in [*rings, *bells] if os.path.exists(path)]
    assert all(not alive(p) for p in ranks)


def test_two_ranks_over_zmq_match_hf_with_recompute_and_pipelined_steps(
    serve_factory, tiny_checkpoint, hf_greedy
) -> None:
    """Also the worker's pipelined loop (step N+1 launched before N's tokens are read, on every rank)."""
    server = serve_factory(
        "--model",
        str(tiny_checkpoint),
        *TP_ARGS,
        "--preemption",
        "recompute",
        "--plan-transport",
        "zmq",
        "--pipeline-steps",
        "on",
    )
    outputs = generate_all(server.address)
    for i in range(N):
        assert outputs[i] == hf_greedy(prompt(i), max_tokens(i)), i
    with Client(server.address, timeout=60) as client:
        stats = wait_for_free_blocks(client)
    assert stats["held_blocks"] == 0, stats
    assert stats["num_preemptions_recompute"] > 0 and stats["num_swapped_out_blocks"] == 0, stats
    assert server.terminate() == 0


def test_the_flag_makes_one_worker_view_per_rank_and_one_plan_reader_each(tmp_path) -> None:
    """No process: what --tensor-parallel-size puts in the configuration the ranks are spawned with."""
    from conveyor.cli.serve import build_parser, server_config
    from conveyor.runtime.config import rank_process_name

    args = build_parser().parse_args(
        ["--model", "demo", "--tensor-parallel-size", "2", "--num-kv-blocks", "8", "--distributed-timeout", "12"]
    )
    config = server_config(args, str(tmp_path))
    ranks = config.worker_ranks()
    assert [(w.tensor_parallel_rank, w.tensor_parallel_size) for w in ranks] == [(0, 2), (1, 2)]
    assert {w.distributed_init_method for w in ranks} == {f"file://{tmp_path}/plans-tp-rendezvous"}  # in the run dir
    assert all(w.distributed_timeout_s == 12 for w in ranks)
    assert config.channels.plans.readers == 2 and config.channels.results.readers == 1
    assert [rank_process_name("worker", w.tensor_parallel_rank) for w in ranks] == ["worker", "worker-rank1"]
    assert config.scheduler.channels == config.channels  # the scheduler sends each plan once, to both
    one = server_config(build_parser().parse_args(["--model", "demo", "--num-kv-blocks", "8"]), str(tmp_path))
    assert len(one.worker_ranks()) == 1 and one.channels.plans.readers == 1
    with pytest.raises(SystemExit):  # argparse: "must be >= 1, got 0"
        build_parser().parse_args(["--tensor-parallel-size", "0"])
    with pytest.raises(ValueError, match="2 readers for 3 tensor-parallel ranks"):
        dataclasses.replace(config.worker, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="rank 2 outside 0..1"):
        dataclasses.replace(config.worker, tensor_parallel_rank=2)


def test_a_rank_loop_sends_from_rank_0_only_and_stops_on_a_failure_that_may_split_the_group() -> None:
    """No process: the worker's step loop as a rank runs it (scripted runner and plans)."""
    from conveyor import profiling
    from conveyor.worker.main import StepLoop
    from tests.worker.test_step_loop import Results, ScriptedPlans, ScriptedRunner, plan

    def rank_loop(runner, results) -> StepLoop:
        plans = ScriptedPlans([plan(1, False), plan(2), plan(3, False)])
        return StepLoop(
            runner, plans, results, profiling.Profiler("worker", enabled=False), False, recoverable=ValueError
        )

    runner = ScriptedRunner(fail_launch={2})  # refused alike on every rank (ValueError): that step fails alone
    rank_loop(runner, None).run()  # a rank other than 0: runs every plan, sends nothing
    assert runner.calls == ["launch 1", "finish 1", "launch 2", "launch 3", "finish 3"]
    results = Results()
    rank_loop(ScriptedRunner(fail_launch={2}), results).run()
    assert [(r.step_id, r.error is None) for r in results.sent] == [(1, True), (2, False), (3, True)]
    runner, results = ScriptedRunner(fail_finish={1}), Results()
    with pytest.raises(RuntimeError, match="device error"):  # the group may be out of step: the rank exits
        rank_loop(runner, results).run()
    assert runner.calls == ["launch 1", "finish 1"] and results.sent == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (rank r on cuda:r)")
def test_two_ranks_on_two_gpus_over_nccl_match_hf(serve_factory, tiny_checkpoint, hf_greedy) -> None:
    """The same server on NCCL: rank 0 on cuda:0, rank 1 on cuda:1, float32 to compare with HF."""
    server = serve_factory(
        "--model",
        str(tiny_checkpoint),
        *TP_ARGS,
        "--device",
        "cuda",
        "--dtype",
        "float32",
        "--num-cpu-blocks",
        "64",
        "--preemption",
        "swap",
    )
    assert "on cuda:0 with 40 KV blocks" in server.output()
    outputs = generate_all(server.address)
    for i in range(N):
        assert outputs[i] == hf_greedy(prompt(i), max_tokens(i)), i
    with Client(server.address, timeout=60) as client:
        stats = wait_for_free_blocks(client)
    assert stats["held_blocks"] == 0 and stats["num_preemptions_swap"] > 0, stats
    assert server.terminate() == 0
