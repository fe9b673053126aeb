"""The tensor-parallel ranks of an in-process engine: ``Engine(tensor_parallel_size=N)``.

The engine's process is rank 0: its runner holds rank 0's shard, as bin/serve's rank-0 worker
does, and it plans every step. Ranks 1 .. N-1 are bin/serve's worker processes, started by
the same entry (:func:`conveyor.worker.main.run_worker`, ``spawn``ed), each loading its shard
and running every plan it reads on the step channel (:mod:`conveyor.ipc.step_channel`, a
shared-memory ring by default): the engine sends each plan there, then runs it itself, so the
ranks meet in the same collectives in the same order. They send nothing back: rank 0's runner
broadcasts the sampled ids and returns the step's result (:mod:`conveyor.worker.parallel`).
As rank 0 reads no plans, the channel has a reader per other rank
(``WorkerConfig.rank0_in_process``). The group meets at a file in a private run directory,
which also holds the ring (or names it in /dev/shm) and the control socket on which each rank
reports ready (or why it failed) as it does to bin/serve.

Lifetime: :meth:`RankGroup.close` (``Engine.close``, ``with Engine(...)``, the engine
collected or the interpreter exiting) sends each rank a Shutdown, joins it (SIGTERM then
SIGKILL after a grace period), leaves the group and removes the rings and the run directory.
The ranks are daemon processes with a parent-death signal (:func:`conveyor.runtime.process.die_with_parent`),
so neither multiprocessing's exit handler nor a killed engine leaves one behind.

Failures: a rank that died is found before the next plan is sent (:meth:`RankGroup.check`);
one that dies during a step breaks a collective on rank 0 within ``distributed_timeout_s``
(gloo's error when a peer's connection closes comes at once). Either way the ranks are out of
step for good: :class:`RanksFailed` says which rank died and how, and every later step raises
it again; the engine must be closed. One tensor-parallel engine per process at a time: the
group is torch.distributed's default one.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import zmq

from conveyor.assembly.build import worker_config
from conveyor.ipc import codec, step_channel, transport
from conveyor.ipc.messages import ProcessFailed, ProcessReady, Shutdown
from conveyor.ipc.step_channel import StepChannels, StepSender
from conveyor.ipc.transport import ServerAddresses
from conveyor.runtime.config import WorkerConfig, rank_process_name
from conveyor.runtime.process import terminate
from conveyor.runtime.tensor_shards import TensorParallel
from conveyor.worker.main import resolve_device, run_worker

# How long a rank found dead may take to show it after a collective failed on rank 0.
DEATH_GRACE_S = 1.0
CANNOT_RUN_ON = ": the engine cannot run on; close it"


class RanksFailed(RuntimeError):
    """A tensor-parallel rank died or the ranks fell out of step: the engine cannot run on."""


class RankGroup:
    """Ranks 1 .. N-1 of an engine as worker processes, and rank 0's membership of the group.

    ``worker``: the worker settings (:func:`conveyor.assembly.build.worker_settings`, with
    ``tensor_parallel_size`` N > 1). Built, the ranks are starting and rank 0 has joined the
    group (:attr:`tp`); the caller builds rank 0's runner on it, agrees on the KV pool, then
    calls :meth:`wait_ready`. Any failure on the way closes what was started and raises.
    """

    def __init__(self, worker: Mapping[str, Any], model_dir: str) -> None:
        from conveyor.worker.parallel import rank_device

        self.size = size = int(worker["tensor_parallel_size"])
        self.timeout_s = float(worker.get("distributed_timeout_s") or WorkerConfig.distributed_timeout_s)
        self.expert_parallel = bool(worker.get("expert_parallel", False))
        device = resolve_device(worker["device"])
        _check_devices(device, size)
        self.run_dir = transport.make_run_dir()
        self.procs: list[mp.process.BaseProcess] = []
        self.tp: TensorParallel | None = None
        self.failure: RanksFailed | None = None
        self._ctx = zmq.Context()
        self._control = self._plans = None
        self._closed = False
        addresses = ServerAddresses.in_run_dir(self.run_dir, f"ipc://{self.run_dir}/unused-client")
        self.channels = StepChannels.for_server(
            self.run_dir, addresses.plans, addresses.results, shm=True, plan_readers=size - 1
        )
        try:
            step_channel.create_rings(self.channels)
            self._control = transport.socket(self._ctx, zmq.PULL, addresses.control, bind=True)
            self._plans = StepSender(self._ctx, self.channels.plans, bind=True)
            rendezvous = f"file://{self.run_dir}/tp-rendezvous"
            config = worker_config(
                worker,
                model_dir=model_dir,
                addresses=addresses,
                channels=self.channels,
                profile=False,  # nobody asks the ranks for profiles here
                tensor_parallel_rank=1,
                distributed_init_method=rendezvous,
                rank0_in_process=True,
                cpu_bind=False,  # the caller's machine: its threads are the caller's to place
                cpu_slots=size,
            )
            spawn = mp.get_context("spawn")
            for rank in range(1, size):
                name = f"conveyor-{rank_process_name('worker', rank)}"
                proc = spawn.Process(
                    target=run_worker, args=(replace(config, tensor_parallel_rank=rank),), name=name, daemon=True
                )
                proc.start()
                self.procs.append(proc)
            self.tp = self._join(
                rendezvous, device, rank_device(device, TensorParallel(0, size), config.runner.first_device)
            )
        except BaseException:
            self.close()
            raise

    def _join(self, rendezvous: str, device: str, own_device: str) -> TensorParallel:
        """Rank 0 joins the group, watching the ranks meanwhile: one that dies first (a script
        without ``if __name__ == "__main__":`` runs itself again in each spawned rank and fails
        there) ends the wait at once rather than after ``distributed_timeout_s``. torch's
        rendezvous cannot be interrupted, so it runs on a thread (left to time out if a rank
        died); its CUDA device is then made current on this one too."""
        import torch

        from conveyor.worker.parallel import default_backend, init_tensor_parallel

        backend = default_backend(device)
        joined: list[TensorParallel | BaseException] = []

        def join() -> None:
            try:
                joined.append(
                    init_tensor_parallel(
                        0, self.size, rendezvous, backend, self.timeout_s, own_device, self.expert_parallel
                    )
                )
            except BaseException as exc:  # (raised on the caller's thread below)
                joined.append(exc)

        thread = threading.Thread(target=join, name="conveyor-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if thread.is_alive() and self._dead():
                raise RanksFailed(
                    f"{_died(self._dead())} before the ranks met (a script that starts an engine "
                    'needs `if __name__ == "__main__":`: the ranks are spawned)'
                )
        if isinstance(joined[0], BaseException):
            raise joined[0]
        if backend == "nccl":
            torch.cuda.set_device(own_device)
        return joined[0]

    def wait_ready(self) -> None:
        """Wait until every rank has reported ready (loaded its shard, agreed on the pool);
        :class:`RanksFailed` with the rank's own reason if one failed, died or took longer
        than ``distributed_timeout_s``."""
        waiting = {proc.pid for proc in self.procs}
        deadline = time.monotonic() + self.timeout_s
        while waiting:
            self.check()
            if time.monotonic() > deadline:
                raise RanksFailed(f"the tensor-parallel ranks did not start within {self.timeout_s:g} s")
            msg = self._control_message(0.1)
            if isinstance(msg, ProcessFailed):
                raise RanksFailed(f"a tensor-parallel rank failed to start: {msg.reason}")
            if isinstance(msg, ProcessReady):
                waiting.discard(msg.pid)

    def start_failure(self) -> RanksFailed | None:
        """Why a rank failed to start, if one reports it within :data:`DEATH_GRACE_S`: what
        rank 0's start-up raised (a collective broken by that rank's exit) is its symptom."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while time.monotonic() < deadline:
            msg = self._control_message(0.05)
            if isinstance(msg, ProcessFailed):
                return RanksFailed(f"a tensor-parallel rank failed to start: {msg.reason}")
        return None

    def _control_message(self, timeout_s: float) -> Any | None:
        """The next message a rank sent on the control socket (ready or failed), if any comes."""
        if self._control is None or not self._control.poll(int(timeout_s * 1000)):
            return None
        return codec.decode(self._control.recv())

    def check(self) -> None:
        """Raise :class:`RanksFailed` if a rank is dead (or the ranks failed before)."""
        if self.failure is None and self._dead():
            self.failure = RanksFailed(_died(self._dead()) + CANNOT_RUN_ON)
        if self.failure is not None:
            raise self.failure

    def _dead(self) -> list[tuple[int, mp.process.BaseProcess]]:
        """(rank, process) of every rank process that is not alive."""
        return [(rank, proc) for rank, proc in enumerate(self.procs, 1) if not proc.is_alive()]

    def send(self, msg: Any) -> None:
        """Send ``msg`` (a plan, a LoRA update, a weight update or sleep) to every rank, after checking they live."""
        self.check()
        self._plans.send(msg)

    def failed(self, exc: BaseException) -> RanksFailed:
        """What a failure of rank 0's step (a collective that broke or timed out) means: the
        rank that died, if one did within :data:`DEATH_GRACE_S`; the ranks are out of step
        either way, so every later step raises the same."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while self.failure is None:
            dead = self._dead()
            if dead or time.monotonic() > deadline:
                cause = _died(dead) if dead else "the tensor-parallel ranks are out of step"
                self.failure = RanksFailed(
                    f"{cause} (rank 0's step failed: {type(exc).__name__}: {exc}){CANNOT_RUN_ON}"
                )
            else:
                time.sleep(0.05)
        return self.failure

    def close(self) -> None:
        """Stop every rank and release the group, the sockets, the rings and the run
        directory; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.failure = self.failure or RanksFailed("the engine is closed")
        from conveyor.worker.parallel import close_tensor_parallel

        if self._plans is not None and any(proc.is_alive() for proc in self.procs):
            try:
                self._plans.send(Shutdown("the engine is closed"))
            except Exception:  # (a ring a dead rank holds full) the ranks are terminated below
                pass
        deadline = time.monotonic() + 2 * DEATH_GRACE_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        terminate(self.procs)
        if self.tp is not None:
            close_tensor_parallel(self.tp)
        if self._plans is not None:
            self._plans.close()
        if self._control is not None:
            self._control.close(linger=0)
        self._ctx.term()
        step_channel.remove_rings(self.channels)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _died(dead: list[tuple[int, mp.process.BaseProcess]]) -> str:
    ranks = ", ".join(f"rank {rank} (pid {proc.pid}, exit code {proc.exitcode})" for rank, proc in dead)
    return f"tensor-parallel {ranks} died"


def _check_devices(device: str, size: int) -> None:
    """One GPU per rank on CUDA (NCCL refuses two ranks on one device); ValueError otherwise.
    One process group per process (torch.distributed's default group)."""
    import torch
    import torch.distributed as dist

    if device.startswith("cuda") and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size {size} needs one GPU per rank: {torch.cuda.device_count()} visible")
    if dist.is_initialized():
        raise ValueError(
            "this process already has a torch.distributed process group (another tensor-parallel "
            "engine that is not closed?): one tensor-parallel engine per process at a time"
        )
