"""A trainer's side of a weight update from a ``torch.distributed`` group, for the tests: a
thread that is group rank 0 and broadcasts its tensors to the engine's ranks."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from conveyor.worker.weight_updates import broadcast_tensors, weight_update_group


@contextmanager
def trainer_broadcasting(tensors: dict[str, torch.Tensor], world_size: int) -> Iterator[tuple[str, list]]:
    """Start a trainer thread (rank 0 of a gloo group of ``world_size`` at a free local address)
    that broadcasts ``tensors``; yields ``(address, specs)`` for the receiving ranks. On exit it
    waits for the trainer and fails the test with whatever the trainer raised."""
    specs = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    errors: list[BaseException] = []

    def trainer() -> None:
        try:
            group = weight_update_group(address, 0, world_size, timeout_s=60)
            for _ in broadcast_tensors(group, specs, list(tensors.values())):
                pass
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    yield address, specs
    thread.join(60)
    assert not thread.is_alive() and not errors, errors
