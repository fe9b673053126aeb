"""The worker process: receives StepPlans, runs them on its model runner, returns StepResults.

A failed step is reported as a StepResult with ``error``; the process exits only when told
to or when its parent dies. With ``pipeline`` (on with CUDA) the next plan is launched before
the step in flight is finished. Tensor parallelism runs one such process per rank, every rank
running every plan (docs/architecture.md, "The step loop").
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from typing import TYPE_CHECKING

import zmq

from conveyor import profiling
from conveyor.ipc import codec
from conveyor.ipc.messages import (
    CommitLora,
    LoadLora,
    LoraRead,
    ProfileQuery,
    ProfileReport,
    Shutdown,
    SleepEngine,
    StepPlan,
    StepResult,
    UnloadLora,
    UpdateWeights,
    WakeEngine,
)
from conveyor.ipc.step_channel import PeerGone, StepSender
from conveyor.ipc.step_receivers import StepReceiver
from conveyor.runtime.config import Device, PipelineSteps, RunnerConfig, WorkerConfig, rank_process_name
from conveyor.runtime.model_source import StartupError
from conveyor.runtime.process import Started, run_process
from conveyor.worker.cpu_threads import bind_process, cpu_thread_info, passive_waits, worker_cores, worker_threads
from conveyor.worker.lora_config import LoraLoadError

if TYPE_CHECKING:  # torch is imported when a runner is built, not with this module
    from conveyor.worker.model_runner import ModelRunner
    from conveyor.worker.parallel import TensorParallel

log = logging.getLogger("conveyor.worker")


DEFAULT_CUDA_SWAP_SPACE = 4 << 30
# How often an idle worker looks whether an adapter read is over (it has no plan to wake it).
READ_POLL_S = 0.005


def default_swap_space(device: str) -> int:
    """Bytes of CPU swap space when none is asked for: 4 GiB of pinned memory beside a GPU;
    none on a CPU device, where "swapping" would only copy within the same RAM."""
    return DEFAULT_CUDA_SWAP_SPACE if device.startswith("cuda") else 0


def resolve_device(device: str) -> str:
    """The torch device to run on: ``auto`` picks cuda when available; asking for cuda
    without one is an error, never a fallback."""
    import torch

    device = str(device)  # a plain str (from a Device member too): torch and the ready message take it
    if device == Device.AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise StartupError(
            f"--device {device}: torch sees no CUDA device here (torch.cuda.is_available() is False); use --device "
            "cpu (or auto)"
        )
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"unsupported device {device!r}: use cpu, cuda or auto")
    return device


def resolve_pipeline(pipeline: str, device: str) -> bool:
    setting = PipelineSteps.parse(pipeline, "pipeline")
    return device.startswith("cuda") if setting == PipelineSteps.AUTO else setting == PipelineSteps.ON


def run_worker(config: WorkerConfig) -> None:
    passive_waits()  # before anything imports torch (conveyor.worker.cpu_threads says why)
    name = rank_process_name("worker", config.tensor_parallel_rank)
    # Expected: a bad adapter, and a checkpoint file that is not there (its path is the message).
    run_process(
        name, config.addresses.control, lambda ctx: _start(config, ctx), expected=(LoraLoadError, FileNotFoundError)
    )


def build_runner(
    config: RunnerConfig, *, profiler: profiling.Profiler | None = None, tensor_parallel: TensorParallel | None = None
) -> ModelRunner:
    """The :class:`~conveyor.worker.model_runner.ModelRunner` ``config`` describes, as the
    worker process and the in-process engine (:mod:`conveyor.engine`) both build theirs:
    torch's CPU threads set when ``num_threads`` is given, the device resolved
    (:func:`resolve_device`; with ``tensor_parallel``, the runner of one rank, None for a single
    process, on CUDA GPU ``first_device + rank``: :func:`~conveyor.worker.parallel.rank_device`),
    and without ``num_cpu_blocks`` nor ``swap_space_bytes`` the device's default swap space
    (:func:`default_swap_space`)."""
    import torch

    from conveyor.worker.model_runner import ModelRunner
    from conveyor.worker.parallel import NO_TENSOR_PARALLEL, rank_device

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    tensor_parallel = tensor_parallel or NO_TENSOR_PARALLEL
    device = rank_device(resolve_device(config.device), tensor_parallel, config.first_device)
    swap = default_swap_space(device) if config.swap_space_bytes is None else config.swap_space_bytes
    config = dataclasses.replace(config, device=device, swap_space_bytes=swap)
    return ModelRunner(config, profiler=profiler, tensor_parallel=tensor_parallel)


def _start(config: WorkerConfig, ctx: zmq.Context) -> Started:
    """Join the tensor-parallel group (with more than one rank), load the model (this rank's
    shard), size the KV pool and the swap space (agreed across ranks), connect the step channel."""
    from conveyor.worker.parallel import (
        TensorParallel,
        close_tensor_parallel,
        default_backend,
        init_tensor_parallel,
        rank_device,
    )
    from conveyor.worker.plan_check import PlanRefused

    rank, size = config.tensor_parallel_rank, config.tensor_parallel_size
    device = resolve_device(config.runner.device)
    tp = init_tensor_parallel(
        rank,
        size,
        config.distributed_init_method,
        default_backend(device),
        config.distributed_timeout_s,
        rank_device(device, TensorParallel(rank, size, None), config.runner.first_device),
        config.expert_parallel,
    )
    prof = profiling.Profiler("worker", enabled=config.profile)

    def idle_fraction(since_ns: int) -> float:
        idle = prof.window_total("idle", since_ns)
        busy = sum(
            prof.window_total(name, since_ns) for name in ("plan_decode", "execute", "wait_tokens", "send_result")
        )
        return idle / (idle + busy) if idle + busy > 0 else 1.0

    prof.derive("idle_fraction", idle_fraction)
    if device.startswith("cuda"):  # kernels compile only there (the CPU runs torch ops, Triton never imported)
        from conveyor.kernels.jit_compiles import COUNTER, count_compiles

        count_compiles(prof.counter(COUNTER).add)
    threads = worker_threads(config.runner.num_threads, config.cpu_slots)
    cores = worker_cores(config.cpu_slot, config.cpu_slots, threads) if config.cpu_bind and device == "cpu" else None
    if cores:  # before the model loads: torch's threads start on them
        bind_process(cores)
    runner = build_runner(dataclasses.replace(config.runner, num_threads=threads), profiler=prof, tensor_parallel=tp)
    num_blocks, num_cpu_blocks = pool_agreed_by_ranks(runner, tp)
    device = str(runner.device)
    loop = StepLoop(
        runner,
        StepReceiver(ctx, config.channels.plans, bind=False, reader=rank - config.rank0_in_process),
        StepSender(ctx, config.channels.results, bind=False) if rank == 0 else None,
        prof,
        resolve_pipeline(config.pipeline, device),
        recoverable=Exception if size == 1 else PlanRefused,
    )

    def close() -> None:
        # The group first: the scheduler sees the plan and result rings close only once this
        # rank is nearly gone, so bin/serve finds the rank's death (the cause) before the
        # scheduler's (its symptom) and reports it.
        close_tensor_parallel(tp)
        loop.close()

    ready = {
        "num_blocks": num_blocks,
        "num_cpu_blocks": num_cpu_blocks,
        "block_bytes": runner.block_bytes,
        "device": device,
        **cpu_thread_info(cores),
    }
    if size > 1:
        ready["tensor_parallel"] = f"rank {rank} of {size}"
    return Started(run=loop.run, close=close, ready_info=ready)


def pool_agreed_by_ranks(runner: ModelRunner, tp: TensorParallel) -> tuple[int, int]:
    """(KV blocks, CPU swap blocks) every rank holds: the minimum over the ranks of each
    rank's own capacity (its share of the memory budget over its share of the kv heads, which
    can differ when kv heads are replicated or devices differ). The scheduler plans with these,
    so every block id it hands out exists on every rank. One rank: the runner's own."""
    if tp.size == 1:
        return runner.num_blocks, runner.num_cpu_blocks
    import torch
    import torch.distributed as dist

    counts = torch.tensor([runner.num_blocks, runner.num_cpu_blocks], dtype=torch.int64, device=runner.device)
    dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=tp.group)
    num_blocks, num_cpu_blocks = counts.tolist()
    return num_blocks, num_cpu_blocks


def failed_step(step_id: int, exc: Exception) -> StepResult:
    """The result of a step whose launch or finish raised (logged with its traceback): the
    scheduler fails the step's requests with this text."""
    log.error("step %d failed:\n%s", step_id, traceback.format_exc())
    return StepResult(step_id, [], [], error=f"worker step failed: {exc}")


class StepLoop:
    """Receives plans, launches and finishes steps on the runner, sends results (pipelined or not).

    ``results`` None: a tensor-parallel rank other than 0, which runs every step and sends
    nothing. A step whose launch or finish raises a ``recoverable`` exception fails alone (its
    result carries the error); any other exception ends the loop (raised), as a tensor-parallel
    rank must when its group may be out of step. The plan planned ahead of a failed step is
    failed by the runner (:mod:`conveyor.worker.model_runner`, the one place of that rule): the
    loop sends what the runner returns or raises, in step order.
    """

    def __init__(
        self,
        runner,
        plans: StepReceiver,
        results: StepSender | None,
        prof: profiling.Profiler,
        pipeline: bool,
        recoverable: type[Exception] = Exception,
    ) -> None:
        self.runner = runner
        self.plans = plans
        self.results = results
        self.recoverable = recoverable
        self.prof = prof
        self.pipeline = pipeline
        self.t_idle = prof.timer("idle", arg_name="step")
        self.t_decode = prof.timer("plan_decode", arg_name="step")
        self.t_execute = prof.timer("execute", arg_name="step")  # launching a step (on a CPU, the whole step)
        self.t_wait = prof.timer("wait_tokens", arg_name="step")  # finishing a launched step
        self.t_send = prof.timer("send_result", arg_name="step")
        self.steps = profiling.StepRecorder(prof)
        self.pending = None  # (launched step, or the StepResult of a launch that failed)
        self.pending_shape: tuple[tuple[int, int, int, int], int] | None = None  # (plan shape, read at)
        from conveyor.worker.lora_updates import AdapterReads  # (torch: imported with the runner, not this module)

        self.reads = AdapterReads(runner.adapters)  # LoRA adapters being read off the loop
        from conveyor.worker.engine_control import EngineControl

        self.control = EngineControl(runner)  # weight updates, sleep and wake

    def run(self) -> None:
        idle_start = profiling.now_ns()
        while True:
            if self.pending is not None and not self._next_plan_or_done():
                self._finish_pending()
                idle_start = profiling.now_ns()
                continue
            if self.reads:
                self._report_reads()
            try:
                while not self.plans.wait(READ_POLL_S if self.reads else None):
                    self._report_reads()  # idle with an adapter being read: report it when it is
                received = profiling.now_ns()
                msg = self.plans.recv(0)
            except codec.DecodeError as exc:
                log.error("dropping malformed plan: %s", exc)
                continue
            except PeerGone as exc:
                log.error("stopping: the scheduler is gone (%s)", exc)
                break
            if isinstance(msg, Shutdown):
                if self.pending is not None:
                    self._finish_pending()
                break
            if isinstance(msg, ProfileQuery):
                if self.results is not None:
                    snapshot = self.prof.snapshot(msg.window_s, trace=msg.trace, series=msg.series)
                    self.results.send(ProfileReport(msg.query_id, [snapshot]))
                continue
            if isinstance(msg, (LoadLora, CommitLora, UnloadLora)):
                self._update_lora(msg)
                continue
            if isinstance(msg, (UpdateWeights, SleepEngine, WakeEngine)):
                if self.pending is not None:  # (the scheduler sends these with no plan in flight)
                    self._finish_pending()
                answer = self.control.apply(msg)
                if self.results is not None:
                    self.results.send(answer)
                idle_start = profiling.now_ns()
                continue
            if not isinstance(msg, StepPlan):
                log.error("unexpected message %s", type(msg).__name__)
                continue
            if self.pending is None:
                self.t_idle.record(idle_start, received, arg=msg.step_id)
            launch_start = self.t_decode.record(received, arg=msg.step_id)
            # (read before the next receive releases the ring slot the plan's arrays view)
            shape = (profiling.plan_shape(msg), received) if self.steps.enabled else None
            if self.pending is not None and not msg.planned_ahead:
                # Formed once the scheduler had the step before's result: it reads that step's
                # outcome (accepted speculative tokens move the computed counts back), so the
                # step is finished first. Rank 0 has always finished it (it sent the result); a
                # tensor-parallel rank > 0 that saw this plan before its step was done has not.
                self._finish_pending()
            try:
                launched = self.runner.launch(msg)
            except self.recoverable as exc:
                launched = failed_step(msg.step_id, exc)
            self.t_execute.record(launch_start, arg=msg.step_id)
            if self.pending is not None:  # step N+1 is queued on the device: now wait for N
                self._finish_pending()
            self.pending, self.pending_shape = launched, shape
            if not self.pipeline or isinstance(launched, StepResult):
                self._finish_pending()
                idle_start = profiling.now_ns()

    def _update_lora(self, msg: LoadLora | CommitLora | UnloadLora) -> None:
        """A LoRA update, between two steps: a load starts its read off the loop, a commit
        registers it on every rank (rank 0 answers), an unload frees the adapter
        (:mod:`conveyor.worker.lora_updates`)."""
        if isinstance(msg, LoadLora):
            self.reads.start(msg)
        elif isinstance(msg, UnloadLora):
            self.runner.adapters.unload_lora(msg.name)
        else:
            answer = self.reads.commit(msg.query_id)
            if answer.ok:
                log.info("LoRA adapter %r loaded", answer.name)
            else:
                log.warning("LoRA adapter %r refused: %s", answer.name, answer.error)
            if self.results is not None:
                self.results.send(answer)

    def _report_reads(self) -> None:
        """Rank 0: tell the scheduler of each adapter read that is over (it then orders the commit)."""
        if self.results is not None:
            for query_id in self.reads.newly_done():
                self.results.send(LoraRead(query_id))

    def close(self) -> None:
        self.reads.close()
        self.plans.close()
        if self.results is not None:
            self.results.close()

    def _next_plan_or_done(self) -> bool:
        """With a step launched: wait until the next message is there (True) or the step is
        done on the device (False), whichever comes first."""
        pending, runner, plans = self.pending, self.runner, self.plans
        if isinstance(pending, StepResult):
            return False
        while True:
            if plans.ready():
                return True
            if runner.step_done(pending):
                return False
            time.sleep(0)  # let other threads run; a GPU step takes milliseconds, this loop microseconds

    def _finish_pending(self) -> None:
        """Finish the launched step (or take the failed launch's result) and send its result."""
        pending, self.pending = self.pending, None
        shape, self.pending_shape = self.pending_shape, None
        start = profiling.now_ns()
        if isinstance(pending, StepResult):
            result = pending
        else:
            try:
                result = self.runner.finish(pending)
            except self.recoverable as exc:
                result = failed_step(pending.step_id, exc)
        send_start = self.t_wait.record(start, arg=result.step_id)
        end = send_start
        if self.results is not None:
            self.results.send(result)
            end = self.t_send.record(send_start, arg=result.step_id)
        if shape is not None and result.error is None:
            self.steps.record(shape[0], shape[1], end)
