"""The worker process: receives StepPlans, runs them on the device, returns StepResults.

A failing step (an exception from the model runner) is reported as a StepResult
with ``error`` set, so the scheduler fails just that step's requests and frees
their blocks; the process itself only exits when told to or when its parent dies.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass

import zmq

from conveyor.common import codec, transport
from conveyor.common.messages import Shutdown, StepPlan, StepResult
from conveyor.common.process import ControlChannel, die_with_parent, setup_logging
from conveyor.common.transport import ServerAddresses

log = logging.getLogger("conveyor.worker")


@dataclass(frozen=True)
class WorkerConfig:
    model_dir: str
    addresses: ServerAddresses
    device: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    num_threads: int | None = None
    attention: str = "auto"


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
        )
        plans = transport.socket(ctx, zmq.PULL, config.addresses.plans, bind=False)
        results = transport.socket(ctx, zmq.PUSH, config.addresses.results, bind=False)
    except Exception as exc:
        log.exception("worker failed to start")
        control.failed(f"worker: {exc}")
        return
    control.ready(num_blocks=runner.num_blocks, device=device)
    try:
        while True:
            try:
                msg = transport.recv(plans)
            except codec.DecodeError as exc:
                log.error("dropping malformed plan: %s", exc)
                continue
            if isinstance(msg, Shutdown):
                break
            if not isinstance(msg, StepPlan):
                log.error("unexpected message %s", type(msg).__name__)
                continue
            start = time.perf_counter()
            try:
                result = runner.execute(msg)
            except Exception as exc:
                log.error("step %d failed:\n%s", msg.step_id, traceback.format_exc())
                result = StepResult(msg.step_id, [], [], error=f"worker step failed: {exc}")
            result.forward_time = time.perf_counter() - start
            transport.send(results, result)
    finally:
        plans.close()
        results.close()
        control.close()
        ctx.term()
