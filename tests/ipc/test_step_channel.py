"""The scheduler <-> worker step channel on both transports: order (also across oversize
plans diverted to ZeroMQ), zero-copy arrays and their lifetime, the poller hand-shake, and a
peer that dies or closes. No torch."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time

import numpy as np
import pytest
import zmq

from conveyor.ipc import step_channel
from conveyor.ipc.messages import CachedRequests, NewRequestData, SamplingParams, Shutdown, StepPlan, StepResult
from conveyor.ipc.step_channel import PeerGone, StepChannels, StepSender
from conveyor.ipc.step_receivers import StepReceiver
from conveyor_tools.stand_in_worker import answer_plans

SPAWN = mp.get_context("spawn")


def _channels(transport: str, plan_readers: int = 1):
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="cv-chan-", dir=base) as run_dir:
        chans = StepChannels.for_server(
            run_dir,
            f"ipc://{run_dir}/plans",
            f"ipc://{run_dir}/results",
            shm=transport == "shm",
            plan_readers=plan_readers,
        )
        step_channel.create_rings(chans)
        try:
            yield chans
        finally:
            step_channel.remove_rings(chans)
        assert not step_channel.ring_files(chans)


@pytest.fixture(params=["shm", "zmq"])
def channels(request):
    yield from _channels(request.param)


@pytest.fixture
def shm_channels():
    """Only the ring can tell a dead or closed peer (ZeroMQ cannot tell one from a quiet peer:
    there, bin/serve's process watch does, see tests/e2e/test_serve.py)."""
    yield from _channels("shm")


def plan(step: int, n: int, prompt_len: int = 0) -> StepPlan:
    """A plan with ``n`` running requests and, with ``prompt_len``, one new request that long."""
    new = []
    if prompt_len:
        tokens = np.arange(prompt_len, dtype=np.int32) % 5000
        new = [NewRequestData(f"new-{step}", 0, tokens, SamplingParams(), list(range(prompt_len // 16 + 1)), 0, 8)]
    slots = [1 + (step + 3 * i) % 97 for i in range(n)]
    return StepPlan(step, new, CachedRequests(slots, np.full(n, step, np.int32), np.ones(n, np.int32)), [0])


def echo(plan: StepPlan) -> StepResult:
    """The stand-in worker's answer: each new request's prompt sum, each cached row the step id."""
    sums = [int(new.token_ids.sum()) for new in plan.new_requests]
    slots = [new.slot for new in plan.new_requests] + plan.cached_requests.slots.tolist()
    tokens = np.array(sums + [plan.step_id] * len(plan.cached_requests), np.int32)
    return StepResult(plan.step_id, slots, tokens)


def test_plans_and_results_in_order_also_when_oversize(channels) -> None:
    """Plans too big for a ring slot (long prompts) go through ZeroMQ without overtaking or
    falling behind the small ones around them."""
    ctx = zmq.Context()
    tx = StepSender(ctx, channels.plans, bind=True)
    rx = StepReceiver(ctx, channels.results, bind=True)
    worker = SPAWN.Process(target=answer_plans, args=(channels, echo), daemon=True)
    worker.start()
    try:
        big = step_channel.PLAN_SLOT_BYTES // 4 + 1000  # int32 tokens: more than one slot
        sent = []
        for step in range(40):
            prompt_len = big if step % 7 == 3 else (step * 13) % 300
            p = plan(step, step % 5, prompt_len)
            tx.send(p)
            sent.append(p)
            if len(sent) < 3:  # three in flight, as the scheduler keeps at most 2 plans + 1 query
                continue
            p = sent.pop(0)
            res = rx.recv(timeout_s=20)
            assert res is not None and res.step_id == p.step_id
            expected = [int(n.token_ids.sum()) for n in p.new_requests] + [p.step_id] * len(p.cached_requests)
            assert res.sampled_token_ids.tolist() == expected
            assert res.slots.tolist() == [n.slot for n in p.new_requests] + list(p.cached_requests.slots)
        for p in sent:
            res = rx.recv(timeout_s=20)
            assert res is not None and res.step_id == p.step_id
        tx.send(Shutdown("done"))
        worker.join(10)
        assert worker.exitcode == 0
    finally:
        if worker.is_alive():
            worker.kill()
        tx.close()
        rx.close()
        ctx.term()


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_every_plan_reaches_every_reader_once_in_order(transport: str) -> None:
    """Tensor parallelism: the scheduler sends each plan once, every rank receives it, in the
    sender's order, oversize plans (diverted to ZeroMQ with shm) included."""
    for channels in _channels(transport, plan_readers=2):
        assert len(step_channel.ring_files(channels)) == (5 if transport == "shm" else 0)  # 2 rings, 3 doorbells
        ctx = zmq.Context()
        tx = StepSender(ctx, channels.plans, bind=True)
        ranks = [StepReceiver(ctx, channels.plans, bind=False, reader=r) for r in range(2)]
        try:
            big = step_channel.PLAN_SLOT_BYTES // 4 + 1000  # int32 tokens: more than one slot
            sent = [plan(step, step % 4, big if step % 5 == 2 else step * 7) for step in range(12)]
            received: list[list[int]] = [[], []]
            for i, p in enumerate(sent):
                tx.send(p)
                if i % 3 == 2 or i == len(sent) - 1:  # never more in flight than the ring holds
                    for rank, rx in enumerate(ranks):
                        while (msg := rx.recv(timeout_s=5 if len(received[rank]) <= i else 0)) is not None:
                            expected = sent[len(received[rank])]
                            assert [n.token_ids.tolist() for n in msg.new_requests] == [
                                n.token_ids.tolist() for n in expected.new_requests
                            ]
                            received[rank].append(msg.step_id)
                            if len(received[rank]) > i:
                                break
            assert received == [list(range(len(sent)))] * 2
            assert all(rx.recv(timeout_s=0) is None for rx in ranks)
        finally:
            tx.close()
            for rx in ranks:
                rx.close()
            ctx.term()
    with pytest.raises(ValueError, match="reader 2 out of range"):
        channels.plans.reader_address(2)


@pytest.fixture
def results_pair(channels):
    """Both ends of the results direction, in this process."""
    ctx = zmq.Context()
    tx = StepSender(ctx, channels.results, bind=True)
    rx = StepReceiver(ctx, channels.results, bind=False)
    try:
        yield tx, rx
    finally:
        tx.close()
        rx.close()
        ctx.term()


def test_received_arrays_view_the_ring_until_the_next_receive(channels, results_pair) -> None:
    tx, rx = results_pair
    tx.send(StepResult(1, [3, 0], [7, 8]))
    tx.send(StepResult(2, [5], [9]))
    first = rx.recv(timeout_s=5)
    assert first.sampled_token_ids.tolist() == [7, 8] and first.slots.tolist() == [3, 0]
    if channels.plans.ring_path is not None:
        assert not first.sampled_token_ids.flags.owndata  # a view over the slot, not a copy
        assert not first.slots.flags.owndata
    second = rx.recv(timeout_s=5)
    assert second.step_id == 2 and second.sampled_token_ids.tolist() == [9]
    assert rx.recv(timeout_s=0) is None


def test_arm_and_poll_wake_on_a_message(results_pair) -> None:
    tx, rx = results_pair
    poller = zmq.Poller()
    poller.register(rx.pollable(), zmq.POLLIN)
    assert not rx.arm()
    assert not poller.poll(50)  # nothing sent: no wake-up
    tx.send(StepResult(5, [], []))
    start = time.monotonic()
    assert poller.poll(5000) and time.monotonic() - start < 5
    rx.disarm()
    assert rx.ready() and rx.recv(0).step_id == 5
    assert not rx.ready()


def sender_that_sleeps(channels: StepChannels) -> None:
    ctx = zmq.Context()
    tx = StepSender(ctx, channels.results, bind=False)
    tx.send(StepResult(1, [], []))
    time.sleep(60)


def test_a_killed_sender_is_noticed_not_waited_on(shm_channels) -> None:
    channels = shm_channels
    ctx = zmq.Context()
    rx = StepReceiver(ctx, channels.results, bind=True)
    proc = SPAWN.Process(target=sender_that_sleeps, args=(channels,), daemon=True)
    proc.start()
    try:
        assert rx.recv(timeout_s=20).step_id == 1  # what it sent before dying is still delivered
        assert rx.peer_alive()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
        start = time.monotonic()
        with pytest.raises(PeerGone):
            rx.recv(timeout_s=None)  # would hang forever if the death went unnoticed
        assert time.monotonic() - start < 5
        assert not rx.peer_alive()
    finally:
        if proc.is_alive():
            proc.kill()
        rx.close()
        ctx.term()


def test_a_closed_sender_ends_the_stream(shm_channels) -> None:
    channels = shm_channels
    ctx = zmq.Context()
    tx = StepSender(ctx, channels.plans, bind=True)
    rx = StepReceiver(ctx, channels.plans, bind=False)
    try:
        tx.send(plan(0, 3))
        tx.close()
        assert rx.recv(timeout_s=5).step_id == 0
        with pytest.raises(PeerGone):
            rx.recv(timeout_s=5)
    finally:
        rx.close()
        ctx.term()


def test_unknown_transport_is_refused() -> None:
    """The transport is chosen by name once, where the config is built; the channels take a flag."""
    from conveyor.runtime.config import PlanTransport

    with pytest.raises(ValueError, match="plan transport must be one of shm, zmq"):
        PlanTransport.parse("tcp", "plan transport")
