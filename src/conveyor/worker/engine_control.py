"""A runner's side of weight updates, sleep and wake (:mod:`conveyor.ipc.messages.engine_control`),
applied between two steps on every tensor-parallel rank alike: the worker loop and
``conveyor.Engine`` (rank 0 in its own process) both go through :class:`EngineControl`.

Every rank receives an update whole and loads its own shard (:mod:`conveyor.worker.weight_updates`):
from a directory each rank reads the files; from a trainer's group every rank is a member
(``rank_offset + rank``) and receives each broadcast; tensors in the engine's process reach
the other ranks by rank 0's broadcasts over the ranks' own group.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from conveyor.ipc.messages import EngineControlled, SleepEngine, UpdateWeights, WakeEngine, WeightSpecs
from conveyor.ipc.messages.engine_control import WEIGHTS_INVALID, WEIGHTS_NOT_FOUND
from conveyor.worker.attention.kv_quant import quantized
from conveyor.worker.kv_cache import KVCacheShape
from conveyor.worker.kv_calibration import calibrate_kv_scales
from conveyor.worker.sleep import Sleep, fall_asleep, wake
from conveyor.worker.weight_updates import (
    broadcast_tensors,
    update_from_disk,
    update_from_group,
    update_from_tensors,
    weight_update_group,
)

log = logging.getLogger("conveyor.worker")


def spec_tuples(specs: WeightSpecs) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``specs`` as :func:`~conveyor.worker.weight_updates.broadcast_tensors` takes them; a
    ValueError naming an unknown dtype."""
    out = []
    for name, dtype, shape in zip(specs.names, specs.dtypes, specs.shapes, strict=True):
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"weight {name!r}: unknown dtype {dtype!r} (a torch dtype name, e.g. 'bfloat16')")
        out.append((name, torch_dtype, tuple(shape)))
    return out


def weight_specs_of(specs: Iterable[tuple[str, torch.dtype, Iterable[int]]]) -> WeightSpecs:
    """(name, torch dtype, shape) triples (a
    :class:`~conveyor.worker.weight_updates.WeightBroadcast`'s) as :class:`WeightSpecs`."""
    triples = list(specs)
    return WeightSpecs(
        [name for name, _, _ in triples],
        [str(dtype).removeprefix("torch.") for _, dtype, _ in triples],
        [list(shape) for _, _, shape in triples],
    )


def weight_specs(tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightSpecs:
    """The :class:`WeightSpecs` of ``(name, tensor)`` pairs, in their order."""
    return weight_specs_of((name, t.dtype, t.shape) for name, t in tensors)


class EngineControl:
    """One runner's sleep state and the commands that change its weights or memory."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.sleep: Sleep | None = None

    def apply(self, msg: UpdateWeights | SleepEngine | WakeEngine, tensors=None) -> EngineControlled:
        """Apply ``msg`` (``tensors``: rank 0's ``(name, tensor)`` pairs of a ``from_rank0``
        update) and say how it went; a refused update leaves the model as it was."""
        answer = EngineControlled(msg.query_id)
        try:
            if isinstance(msg, UpdateWeights):
                self.update(msg, tensors)
            elif isinstance(msg, SleepEngine):
                if self.sleep is not None:
                    raise ValueError(f"already asleep (level {self.sleep.level})")
                self.sleep = fall_asleep(self.runner, msg.level)
                answer.freed_bytes = self.sleep.freed_bytes
            elif self.sleep is not None:
                wake(self.runner, self.sleep, self.runner.config.model_dir)
                if self.sleep.weights is not None:  # the checkpoint's weights again: their scales
                    self._recalibrate_kv_scales()
                self.sleep = None
        except OSError as exc:  # (not there, not a directory, unreadable)
            answer.code, answer.error = WEIGHTS_NOT_FOUND, f"weight update refused, the model is unchanged: {exc}"
        except ValueError as exc:
            answer.code, answer.error = WEIGHTS_INVALID, str(exc)
        except RuntimeError as exc:  # torch.distributed's: the trainer's group failed or timed out
            if not (isinstance(msg, UpdateWeights) and msg.group is not None):
                raise
            answer.code = WEIGHTS_INVALID
            answer.error = f"the trainer's group failed ({exc}): the weights may be partly updated, update again"
        if not answer.ok:
            log.warning("%s refused: %s", type(msg).__name__, answer.error)
        return answer

    def update(self, msg: UpdateWeights, tensors=None) -> None:
        if self.sleep is not None:
            raise ValueError("the weights cannot be updated while asleep: wake it up first")
        model, tp = self.runner.model, self.runner.tensor_parallel
        if msg.path is not None:
            update_from_disk(model, msg.path)
        elif msg.group is not None:
            group = msg.group
            specs = spec_tuples(group.specs)
            pg = weight_update_group(group.address, group.rank_offset + tp.rank, group.world_size, group.timeout_s)
            update_from_group(model, pg, specs)
        elif msg.from_rank0 is not None:
            specs = spec_tuples(msg.from_rank0)
            if tp.size == 1:
                update_from_tensors(model, tensors)
            else:  # every rank in the same broadcasts, rank 0 sending what it holds
                sent = None if tp.rank else [t for _, t in tensors]
                update_from_tensors(model, broadcast_tensors(tp.group, specs, sent))
        else:
            raise ValueError("a weight update names no source (a path, a group or tensors)")
        self._recalibrate_kv_scales()

    def _recalibrate_kv_scales(self) -> None:
        """An 8-bit KV cache's per-layer scales measured again on the new weights (as at start,
        every rank at once: :mod:`conveyor.worker.kv_calibration`); the cache holds nothing
        then (no request runs over an update). Not under CUDA graphs, whose captured decode
        steps hold the old scales: there the scales stay the start's (docs/rl.md)."""
        runner = self.runner
        if not quantized(runner.kv_cache_dtype):
            return
        if runner.device.type == "cuda" and not runner.config.enforce_eager:
            log.warning("8-bit KV cache: its scales stay the start's after a weight update (CUDA graphs hold them)")
            return
        shape = KVCacheShape.of(
            runner.model_config, runner.config.block_size, runner.kv_cache_dtype, runner.tensor_parallel
        )
        runner.model.bind_kv_cache(runner.kv_caches, calibrate_kv_scales(runner.model, shape, runner.kv_cache_dtype))
