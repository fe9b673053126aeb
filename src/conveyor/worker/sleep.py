"""Sleep and wake: a runner gives its memory back while a trainer runs, and takes it again after.

Level 1 frees the KV cache and the swap space (the model's and a draft's), the decode step's
logits buffer and, on CUDA, its captured graphs with their memory pool; level 2 also the
weights (and their packed CPU copies), which waking reloads from the checkpoint directory.
Memory is freed by shrinking the tensors' storages to nothing, not by dropping the tensors:
the model's layers, the step parts and the block copies keep the same tensor objects, and
waking regrows the storages (zeroed caches; weights read again), so nothing else is rebuilt.
The KV contents are lost: the caller drops its prefix cache and holds no request over a sleep.

Regrown storages have new device addresses, which the graphs captured at start would still
read: the graphs are dropped at sleep, and captured again (the same keys, by the start's
capture) once waking has the caches and weights back (:meth:`EngineControl.apply
<conveyor.worker.engine_control.EngineControl.apply>`, after an 8-bit cache's scales are
measured again). On CUDA the freed memory also leaves the caching allocator
(``torch.cuda.empty_cache``), so a trainer in the same process or on the same GPU gets it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from conveyor.worker.models.layers import Linear
from conveyor.worker.weight_updates import update_from_disk


class Storages:
    """Storages shrunk to nothing, each with the bytes it held, for :meth:`regrow`."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen[storage.data_ptr()] = (storage, storage.nbytes())
        self.held = list(seen.values())
        for storage, _ in self.held:
            storage.resize_(0)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.held)

    def regrow(self) -> None:
        for storage, nbytes in self.held:
            storage.resize_(nbytes)


class Sleep:
    """The memory a sleeping runner gave back, and how to take it again."""

    def __init__(self, level: int, caches: Storages, weights: Storages | None) -> None:
        self.level, self.caches, self.weights = level, caches, weights

    @property
    def freed_bytes(self) -> int:
        return self.caches.nbytes + (self.weights.nbytes if self.weights else 0)


def fall_asleep(runner, level: int) -> Sleep:
    """Free ``runner``'s KV caches (level 1), and its weights too (level 2)."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 (the KV cache) or 2 (the KV cache and the weights), got {level}")
    cuda = runner.device.type == "cuda"
    if cuda:  # (nothing queued still reads what is freed here)
        torch.cuda.synchronize(runner.device)
    runner.decode.release_graphs()  # (they read the storages freed here)
    caches = Storages(
        [tensor for pair in runner.cache_sets for tensors in pair for tensor in tensors] + [runner.decode.logits]
    )
    weights = None
    if level == 2:
        for module in runner.model.modules():
            if isinstance(module, Linear):
                module.packed = None  # re-packed when the weights are read again
        if hasattr(runner.model, "tied_head_packed"):
            runner.model.tied_head_packed = None
        weights = Storages(runner.model.parameters())
    if cuda:
        torch.cuda.empty_cache()
    return Sleep(level, caches, weights)


def wake(runner, sleep: Sleep, model_dir: str | Path) -> None:
    """Take back what :func:`fall_asleep` freed: zeroed caches, weights read from ``model_dir``.
    The decode graphs are the caller's to capture again, once the weights are final (an
    8-bit cache's scales, measured on them, are baked into the graphs)."""
    sleep.caches.regrow()
    for caches, swap in runner.cache_sets:
        for tensor in (*caches, *swap):
            tensor.zero_()
    if sleep.weights is not None:
        sleep.weights.regrow()
        update_from_disk(runner.model, model_dir)
