"""The worker process: receives StepPlans, runs them on the device, returns StepResults.

A failing step (an exception from the model runner) is reported as a StepResult
with ``error`` set, so the scheduler fails just that step's requests and frees
their blocks; the process itself only exits when told to or when its parent dies.

Profiling: the time blocked waiting for the next plan (``idle``), decoding it, executing it
(with the runner's swaps, input preparation, forward and sampling inside) and sending the result
are timed per step; ``idle_fraction`` over the window says how much of the time the device
waited for the scheduler and the transport. A ProfileQuery is answered on the result socket
as soon as it is read: it arrives on the plan socket, so always between two steps, and
piggybacks on nothing (StepResult stays as small as it was).

Plans arrive on the step channel (:mod:`conveyor.common.step_channel`; a shared-memory ring
by default): a plan is decoded in place and its arrays view the ring slot, which is released
when the next plan is asked for, after the step has run and its result was sent. The runner
copies what it keeps. If the scheduler's process is gone, the wait for a plan ends
(PeerGone) and the worker exits.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass

import zmq

from conveyor.common import codec, profiling
from conveyor.common.messages import ProfileQuery, ProfileReport, Shutdown, StepPlan, StepResult
from conveyor.common.process import ControlChannel, die_with_parent, setup_logging
from conveyor.common.step_channel import PeerGone, StepChannels, StepReceiver, StepSender
from conveyor.common.transport import ServerAddresses

log = logging.getLogger("conveyor.worker")


@dataclass(frozen=True)
class WorkerConfig:
    model_dir: str
    addresses: ServerAddresses
    channels: StepChannels  # plans from the scheduler, results back
    device: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    num_threads: int | None = None
    attention: str = "auto"
    # CPU swap space: a block count, or bytes (None for both: no swap space).
    num_cpu_blocks: int | None = None
    swap_space_bytes: int | None = None
    profile: bool = True  # record latency profiles (bin/serve --profile / --no-profile)


DEFAULT_CUDA_SWAP_SPACE = 4 << 30


def default_swap_space(device: str) -> int:
    """Bytes of CPU swap space when none is asked for: 4 GiB of pinned memory beside a GPU;
    none on a CPU device, where "swapping" would only copy within the same RAM."""
    return DEFAULT_CUDA_SWAP_SPACE if device.startswith("cuda") else 0


def resolve_device(device: str) -> str:
    """``auto`` picks cuda when available; asking for cuda without one is an error, never a fallback."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but no CUDA device is available (torch.cuda.is_available() is False)")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"unsupported device {device!r}: use cpu, cuda or auto")
    return device


def run_worker(config: WorkerConfig) -> None:
    die_with_parent()
    log = setup_logging("worker")
    ctx = zmq.Context()
    control = ControlChannel(ctx, config.addresses.control, "worker")
    prof = profiling.Profiler("worker", enabled=config.profile)
    t_idle = prof.timer("idle", arg_name="step")
    t_decode = prof.timer("plan_decode", arg_name="step")
    t_execute = prof.timer("execute", arg_name="step")
    t_send = prof.timer("send_result", arg_name="step")

    def idle_fraction(since_ns: int) -> float:
        idle = prof.window_total("idle", since_ns)
        busy = sum(prof.window_total(name, since_ns) for name in ("plan_decode", "execute", "send_result"))
        return idle / (idle + busy) if idle + busy > 0 else 1.0

    prof.derive("idle_fraction", idle_fraction)
    try:
        import torch

        from conveyor.worker.model_runner import ModelRunner

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = resolve_device(config.device)
        runner = ModelRunner(
            config.model_dir,
            device=device,
            dtype=config.dtype,
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            attention=config.attention,
            num_cpu_blocks=config.num_cpu_blocks,
            swap_space_bytes=default_swap_space(device) if config.swap_space_bytes is None else config.swap_space_bytes,
            profiler=prof,
        )
        plans = StepReceiver(ctx, config.channels.plans, bind=False)
        results = StepSender(ctx, config.channels.results, bind=False)
    except Exception as exc:
        log.exception("worker failed to start")
        control.failed(f"worker: {exc}")
        return
    control.ready(
        num_blocks=runner.num_blocks, num_cpu_blocks=runner.num_cpu_blocks, block_bytes=runner.block_bytes, device=device
    )
    try:
        idle_start = profiling.now_ns()
        while True:
            try:
                plans.wait()
                received = profiling.now_ns()
                msg = plans.recv(0)
            except codec.DecodeError as exc:
                log.error("dropping malformed plan: %s", exc)
                continue
            except PeerGone as exc:
                log.error("stopping: the scheduler is gone (%s)", exc)
                break
            if isinstance(msg, Shutdown):
                break
            if isinstance(msg, ProfileQuery):
                snapshot = prof.snapshot(msg.window_s, trace=msg.trace, series=msg.series)
                results.send(ProfileReport(msg.query_id, [snapshot]))
                continue
            if not isinstance(msg, StepPlan):
                log.error("unexpected message %s", type(msg).__name__)
                continue
            t_idle.record(idle_start, received, arg=msg.step_id)
            exec_start = t_decode.record(received, arg=msg.step_id)
            start = time.perf_counter()
            try:
                result = runner.execute(msg)
            except Exception as exc:
                log.error("step %d failed:\n%s", msg.step_id, traceback.format_exc())
                result = StepResult(msg.step_id, [], [], error=f"worker step failed: {exc}")
            result.forward_time = time.perf_counter() - start
            send_start = t_execute.record(exec_start, arg=msg.step_id)
            results.send(result)
            idle_start = t_send.record(send_start, arg=msg.step_id)
    finally:
        plans.close()
        results.close()
        control.close()
        ctx.term()
