"""A worker's end of the step channels with no model behind it, for tests and benchmarks of
the plan/result transport: what it measures or checks is the channel, so the answer to each
plan is whatever function the caller gives."""

from __future__ import annotations

from collections.abc import Callable

import zmq

from conveyor.ipc.messages import Shutdown, StepPlan, StepResult
from conveyor.ipc.step_channel import StepChannels, StepSender
from conveyor.ipc.step_receivers import StepReceiver


def answer_plans(channels: StepChannels, answer: Callable[[StepPlan], StepResult]) -> None:
    """Connect to ``channels`` as the worker does and send ``answer(plan)`` for each plan, in
    order, until :class:`Shutdown`; both sockets and the context are closed on the way out.
    Meant as a ``multiprocessing`` target, so ``answer`` must be a module-level function."""
    ctx = zmq.Context()
    plans = StepReceiver(ctx, channels.plans, bind=False)
    results = StepSender(ctx, channels.results, bind=False)
    try:
        while not isinstance(plan := plans.recv(), Shutdown):
            results.send(answer(plan))
    finally:
        plans.close()
        results.close()
        ctx.term()
