"""LoRA adapters loaded and unloaded while the worker serves (:mod:`conveyor.ipc.messages.lora_updates`).

**Where the files are read: off the step loop.** Reading an adapter (safetensors, the checks,
float32 copies) costs far more than a decode step (docs/architecture.md, "LoRA adapters"), so
a ``LoadLora`` only starts the read on a thread of :class:`AdapterReads`; the loop runs its
steps meanwhile. The read changes nothing the steps use. **Where it is registered: between
two steps, at a point the scheduler orders.** Tensor-parallel ranks must agree (all take the
adapter or none, by one collective), and a collective lines up with the others only at the same
point of every rank's plan stream; a rank cannot tell the others when its thread is done. So
rank 0 tells the scheduler (``LoraRead``), the scheduler sends ``CommitLora`` on the plan
channel, and every rank, reading it between the same two plans, takes its read's outcome
(waiting for its own thread if it is still reading), registers the adapter and agrees
(:meth:`LoraUpdates.add_lora`); rank 0 answers ``LoraUpdated``. With one rank the same path runs:
one more hop to the scheduler, no step waits for the files.

:class:`LoraUpdates` is the part of :class:`~conveyor.worker.model_runner.ModelRunner` that
does it (a base class of it: it uses the runner's ``lora``, ``tensor_parallel`` and ``device``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from conveyor.ipc.messages import LORA_INVALID, LORA_NOT_FOUND, LoadLora, LoraUpdated
from conveyor.worker.lora import LoraAdapter, LoraFilesMissing, LoraLoadError
from conveyor.worker.parallel import all_ranks_agree

if TYPE_CHECKING:
    import torch

    from conveyor.worker.lora import LoraManager
    from conveyor.worker.parallel import TensorParallel


class LoraUpdates:
    """Reading, registering and forgetting adapters on one rank (module docstring)."""

    lora: LoraManager | None
    tensor_parallel: TensorParallel
    device: torch.device

    def read_lora(self, name: str, directory: str) -> LoraAdapter:
        """Read and check the adapter in ``directory`` (:meth:`LoraManager.read`); changes no
        state, so it may run on another thread. Raises :class:`LoraLoadError`."""
        if self.lora is None:
            raise LoraLoadError(
                "LoRA is off: start with adapters or the right to load them "
                "(bin/serve --lora-modules or --enable-lora-loading; Engine lora_modules or enable_lora)"
            )
        try:
            return self.lora.read(name, directory)
        except LoraLoadError:
            raise
        except Exception as exc:  # a truncated or foreign weights file: safetensors' or torch's own error
            raise LoraLoadError(f"adapter {name!r}: cannot read {directory}: {type(exc).__name__}: {exc}") from None

    def add_lora(self, name: str, directory: str, read: Callable[[], LoraAdapter]) -> None:
        """Register the adapter ``read()`` gives (:meth:`read_lora`'s, or its error) as ``name``
        on every tensor-parallel rank or on none (every rank calls this at the same point of
        its plan stream). Raises :class:`LoraLoadError` (what is wrong; another rank's failure
        is only named, its log says why), leaving every rank as it was."""
        error: LoraLoadError | None = None
        try:
            adapter = read()  # (first: it raises the LoRA-off error, on every rank alike)
            self.lora.register(name, directory, adapter)
        except LoraLoadError as exc:
            error = exc
        if not all_ranks_agree(error is None, self.tensor_parallel, self.device):
            if error is None:
                self.lora.unregister(name)
                error = LoraLoadError(f"adapter {name!r} could not be loaded on another tensor-parallel rank (see its log)")
            raise error

    def load_lora(self, name: str, directory: str) -> None:
        """Read and register the adapter at once (the in-process engine's load)."""
        self.add_lora(name, directory, lambda: self.read_lora(name, directory))

    def unload_lora(self, name: str) -> None:
        """Forget adapter ``name`` (its slot and host copy): no plan still to come names it."""
        if self.lora is not None and name in self.lora.names:
            self.lora.unregister(name)


class AdapterReads:
    """The worker loop's adapter reads in progress: started on a ``LoadLora``, reported done
    once by rank 0 (:meth:`newly_done`), committed on the scheduler's ``CommitLora``."""

    def __init__(self, runner: LoraUpdates) -> None:
        self.runner = runner
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
        self._reads: dict[str, tuple[LoadLora, Future[LoraAdapter], bool]] = {}  # query id -> (load, read, reported)

    def __bool__(self) -> bool:
        return bool(self._reads)

    def start(self, msg: LoadLora) -> None:
        self._reads[msg.query_id] = (msg, self._pool.submit(self.runner.read_lora, msg.name, msg.path), False)

    def newly_done(self) -> list[str]:
        """Query ids whose read ended since the last call (rank 0 reports them: ``LoraRead``)."""
        done = [query_id for query_id, (_, read, reported) in self._reads.items() if read.done() and not reported]
        for query_id in done:
            msg, read, _ = self._reads[query_id]
            self._reads[query_id] = (msg, read, True)
        return done

    def commit(self, query_id: str) -> LoraUpdated:
        """Register the read's adapter on every rank or none (:meth:`LoraUpdates.add_lora`); the answer."""
        if query_id not in self._reads:  # never started here: nothing to agree on
            return LoraUpdated(query_id, "", LORA_INVALID, f"no adapter read {query_id!r} on this worker")
        msg, read, _ = self._reads.pop(query_id)
        answer = LoraUpdated(query_id, msg.name)
        try:
            self.runner.add_lora(msg.name, msg.path, read.result)
        except LoraLoadError as exc:
            answer.code = LORA_NOT_FOUND if isinstance(exc, LoraFilesMissing) else LORA_INVALID
            answer.error = str(exc)
        return answer

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
