"""The runner's LoRA side: a new request's adapter, each step's adapter batch, and the
adapters loaded and unloaded while the worker serves (:mod:`conveyor.ipc.messages.lora_updates`).

A load's files are read on a thread (:class:`AdapterReads`) while steps run, and registered
between two steps at a point the scheduler orders, so tensor-parallel ranks agree
(docs/architecture.md, "Loading adapters while serving").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch

from conveyor.ipc.messages import LORA_INVALID, LORA_NOT_FOUND, LoadLora, LoraUpdated
from conveyor.worker.lora import LoraAdapter, LoraFilesMissing, LoraLoadError, LoraManager
from conveyor.worker.parallel import TensorParallel, all_ranks_agree
from conveyor.worker.plan_check import PlanRefused
from conveyor.worker.request_state import RequestState


class LoraUpdates:
    """The adapters of one rank (``lora``, None: LoRA off), registered on every rank of
    ``tensor_parallel`` or none."""

    def __init__(self, lora: LoraManager | None, tensor_parallel: TensorParallel, device: torch.device) -> None:
        self.lora = lora
        self.tensor_parallel = tensor_parallel
        self.device = device

    def adapter_id(self, name: str | None) -> int:
        """The id of a new request's adapter; PlanRefused (before any state changes) for one
        the runner does not hold (a race with an unload, or LoRA off)."""
        if not name:
            return 0
        if self.lora is None or name not in self.lora.names:
            raise PlanRefused(f"unknown LoRA adapter {name!r}")
        return self.lora.adapter_id(name)

    @contextmanager
    def step(self, states: list[RequestState], row_tokens: np.ndarray) -> Iterator[bool]:
        """The step's adapter batch while the forward runs (rows in ``states`` order,
        ``row_tokens`` tokens each, padding rows past ``states`` run the base model); yields
        whether any row has an adapter."""
        if self.lora is None:
            yield False
            return
        adapters = np.zeros(len(row_tokens), dtype=np.int64)
        adapters[: len(states)] = [state.adapter for state in states]
        with_adapters = self.lora.begin_step(adapters, row_tokens)
        try:
            yield with_adapters
        finally:
            self.lora.end_step()

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
                error = LoraLoadError(
                    f"adapter {name!r} could not be loaded on another tensor-parallel rank (see its log)"
                )
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

    def __init__(self, adapters: LoraUpdates) -> None:
        self.adapters = adapters
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
        self._reads: dict[str, tuple[LoadLora, Future[LoraAdapter], bool]] = {}  # query id -> (load, read, reported)

    def __bool__(self) -> bool:
        return bool(self._reads)

    def start(self, msg: LoadLora) -> None:
        self._reads[msg.query_id] = (msg, self._pool.submit(self.adapters.read_lora, msg.name, msg.path), False)

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
            self.adapters.add_lora(msg.name, msg.path, read.result)
        except LoraLoadError as exc:
            answer.code = LORA_NOT_FOUND if isinstance(exc, LoraFilesMissing) else LORA_INVALID
            answer.error = str(exc)
        return answer

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
