"""New weights into a loaded model, in place: from a checkpoint directory, from named tensors, or
broadcast by a trainer over a process group of its own (RL between training steps).

Every source goes through :func:`conveyor.worker.loader.load_weights`, the path a start-up
load takes, so a tensor-parallel rank copies only its shard and the model re-derives what it
derives from stored weights (packed CPU copies, Gemma's ``1 + w`` norms). An update must name
every weight the model loads, once, with the checkpoint's shapes: that is checked before the
first copy, so a bad update is refused whole and the model keeps serving its old weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from conveyor.worker.loader import checkpoint_tensors, load_weights
from conveyor.worker.models.interface import CausalLM


class TensorSlice:
    """A tensor read the way :func:`load_weights` reads a safetensors slice."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]


def check_update(model: CausalLM, shapes: Mapping[str, Sequence[int]], source: str) -> None:
    """ValueError unless ``shapes`` (name -> shape) names every weight ``model`` loads with its
    checkpoint shape, and nothing the model does not know."""
    layout = model.checkpoint_layout()
    unknown = sorted(set(shapes) - set(layout))
    missing = sorted(name for name, slot in layout.items() if slot is not None and name not in shapes)
    wrong = sorted(
        f"{name} {tuple(shape)} (expected {layout[name].shape})"
        for name, shape in shapes.items()
        if layout.get(name) is not None and tuple(shape) != layout[name].shape
    )
    problems = [
        f"{label}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
        for label, names in (("unknown weights", unknown), ("missing weights", missing), ("wrong shapes", wrong))
        if names
    ]
    if problems:
        raise ValueError(f"weight update from {source} refused, the model is unchanged: {'; '.join(problems)}")


@torch.no_grad()
def update_from_tensors(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load ``(name, tensor)`` pairs (checkpoint names, whole tensors) into ``model``."""
    named = list(tensors)
    if len({name for name, _ in named}) != len(named):
        raise ValueError("weight update from tensors refused, the model is unchanged: a weight is named twice")
    check_update(model, {name: tuple(t.shape) for name, t in named}, "tensors")
    load_weights(model, (("tensors", name, TensorSlice(t)) for name, t in named))


@torch.no_grad()
def update_from_disk(model: CausalLM, model_dir: str | Path) -> None:
    """Load the checkpoint in ``model_dir`` (safetensors or GGUF, as at start) into ``model``.
    Its files are opened once: the slices listed (headers only) are checked, then read."""
    model_dir = Path(model_dir)
    stored = list(checkpoint_tensors(model_dir))
    check_update(model, {name: tuple(tensor.get_shape()) for _, name, tensor in stored}, str(model_dir))
    load_weights(model, stored)


def weight_update_group(address: str, rank: int, world_size: int, timeout_s: float = 300.0) -> dist.ProcessGroup:
    """A gloo group of ``world_size`` members meeting at ``address`` (``host:port``; rank 0, the
    trainer's broadcasting rank, hosts the store), apart from any group the server's
    tensor-parallel ranks use: the trainer is no member of those."""
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
    return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))


def broadcast_tensors(
    group: dist.ProcessGroup,
    specs: Sequence[tuple[str, torch.dtype, Sequence[int]]],
    tensors: Sequence[torch.Tensor] | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of ``specs`` (name, dtype, shape), one broadcast from group rank 0 each: rank 0
    passes ``tensors`` (in ``specs``' order), the others None and receive. Yields as they arrive."""
    for i, (name, dtype, shape) in enumerate(specs):
        if tensors is not None:
            buffer = tensors[i].detach().to("cpu", dtype).contiguous()
        else:
            buffer = torch.empty(tuple(shape), dtype=dtype)
        group.broadcast([buffer], dist.BroadcastOptions()).wait()
        yield name, buffer


@torch.no_grad()
def update_from_group(
    model: CausalLM, group: dist.ProcessGroup, specs: Sequence[tuple[str, torch.dtype, Sequence[int]]]
) -> None:
    """Receive the weights of ``specs`` broadcast by the trainer (group rank 0) into ``model``.

    The specs are checked before the first broadcast is received, but a refused update still
    needs the trainer to know: the server checks the specs when the trainer announces them,
    before the trainer starts sending."""
    check_update(model, {name: tuple(shape) for name, _, shape in specs}, "the trainer's group")
    load_weights(model, (("group", name, TensorSlice(t)) for name, t in broadcast_tensors(group, specs, None)))


@dataclass(frozen=True)
class WeightBroadcast:
    """A weight update the trainer broadcasts: the group's ``address`` (``host:port``, hosted by
    the trainer, group rank 0), this engine's ``rank`` in it, its ``world_size``, and the
    ``specs`` (name, dtype, shape) of the tensors, in the order the trainer sends them."""

    address: str
    rank: int
    world_size: int
    specs: Sequence[tuple[str, torch.dtype, Sequence[int]]]
    timeout_s: float = 300.0

    def group(self) -> dist.ProcessGroup:
        return weight_update_group(self.address, self.rank, self.world_size, self.timeout_s)
