"""What a model must offer the worker: the one interface every architecture implements.

The runner, the loader, LoRA, tensor parallelism, the CUDA-graph decode step and the
speculative draft all use a model through :class:`CausalLM` and nothing else, so a new
architecture is one module implementing it plus its line in
:data:`conveyor.checkpoints.architectures.MODEL_CLASSES` (the registry,
:mod:`.registry`, builds it by the checkpoint's HF ``architectures`` name).

Invariants every implementation keeps (the runner, LoRA and the tests rely on them):

* **Batches are flattened and ragged.** ``forward(input_ids [T], positions [T], metadata)``
  runs the ``T`` new tokens of many sequences laid end to end (no padding, no batch dim),
  attention through the :class:`~conveyor.worker.attention.backend.AttentionBackend` it was
  built with, over the paged KV cache bound by :meth:`CausalLM.bind_kv_cache` (one tensor
  per layer, shaped by :class:`~conveyor.worker.kv_cache.KVCacheShape` from the config:
  ``num_layers`` layers of ``num_kv_heads`` heads of ``head_dim``). It returns the final
  hidden states ``[T, hidden]``; :meth:`CausalLM.compute_logits` turns the rows the caller
  picked into float32 logits. The forward reads only its arguments and the bound cache (the
  decode step captures it in a CUDA graph over static buffers): no host syncs, no shapes
  from tensor values.
* **Attention layers are frozen descriptions.** Each layer attends through one
  :class:`~conveyor.worker.attention.backend.AttentionLayer` (heads on this rank, scale,
  sliding window, rotary table, q/k norms, cache); :meth:`CausalLM.attention_layers` lists
  them in layer order, and the decode step plans its kernels from their windows.
* **Weights come from the checkpoint layout.** :meth:`CausalLM.checkpoint_layout` maps every
  tensor name a checkpoint may hold to a :class:`WeightSlot` (or ``None``: present and
  ignored); the loader fills every slot exactly once and then calls
  :meth:`CausalLM.weights_loaded`. Under tensor parallelism (``tensor_parallel`` of size N)
  the model is rank ``tensor_parallel.rank``'s shard: column-parallel projections hold their
  rows, row-parallel ones (:class:`~conveyor.worker.models.layers.RowParallelLinear`) their
  input columns and all-reduce, and the slots name the slice of each checkpoint tensor the
  rank reads. Only rank 0 holds an LM head and computes logits.
* **LoRA attaches to projections named by the layout.** :attr:`CausalLM.lora_targets` names
  the checkpoint projections an adapter may target (``q_proj`` ...) and where each sits
  (``self_attn`` or ``mlp`` of ``model.layers.N``, its piece of a fused projection); the
  layout's slot of ``model.layers.N.<sub>.<target>.weight`` names the
  :class:`~conveyor.worker.models.layers.Linear` it attaches a stack to, and its rows and
  columns the rank's shard of the adapter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.worker.attention.backend import AttentionBackend, AttentionLayer, AttentionMetadata
from conveyor.worker.attention.kv_quant import KVScales
from conveyor.worker.parallel import TensorParallel


@dataclass(frozen=True)
class WeightSlot:
    """Where one checkpoint tensor goes: its part ``rows`` x ``cols`` fills rows ``start:end``
    (dim 0) of our parameter ``name``.

    ``shape`` is the checkpoint tensor's whole shape, checked before anything is read;
    ``rows`` and ``cols`` are ``(begin, end)`` ranges of its dims 0 and 1 (``None``: all of
    it), so a tensor-parallel rank reads only its shard.
    """

    name: str
    start: int
    end: int
    shape: tuple[int, ...]
    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None


@dataclass(frozen=True)
class LoraTarget:
    """A projection LoRA may target: it is ``model.layers.N.<module>.<name>`` in checkpoints
    and adapters, and fills piece ``piece`` of its (possibly fused) projection: q/k/v are
    pieces 0, 1, 2 of ``qkv_proj``, gate/up pieces 0, 1 of ``gate_up_proj``, the rest 0."""

    module: str
    piece: int


#: The projections of a Llama-style decoder layer, the LoRA targets of every model here so far.
DECODER_LORA_TARGETS: Mapping[str, LoraTarget] = {
    "q_proj": LoraTarget("self_attn", 0),
    "k_proj": LoraTarget("self_attn", 1),
    "v_proj": LoraTarget("self_attn", 2),
    "o_proj": LoraTarget("self_attn", 0),
    "gate_proj": LoraTarget("mlp", 0),
    "up_proj": LoraTarget("mlp", 1),
    "down_proj": LoraTarget("mlp", 0),
}


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only causal LM as the worker uses it (module docstring: the invariants).

    Implementations are ``torch.nn.Module`` subclasses built as
    ``cls(config, backend, dtype, device, tensor_parallel)`` with uninitialised parameters,
    which the loader then fills through :meth:`checkpoint_layout`.
    """

    #: Checkpoint projection name -> where it sits (module docstring: LoRA).
    lora_targets: ClassVar[Mapping[str, LoraTarget]]

    config: ModelConfig
    tensor_parallel: TensorParallel

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
        tensor_parallel: TensorParallel,
    ) -> None: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """``forward``: final hidden states ``[T, hidden]`` of the flattened batch ``input_ids`` ``[T]``
        at ``positions`` ``[T]``, its keys and values written to the bound cache."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 ``[N, vocab]`` logits of ``hidden`` ``[N, hidden]`` (rank 0 only)."""
        ...

    def bind_kv_cache(self, kv_caches: list[torch.Tensor], scales: list[KVScales] | None = None) -> None:
        """Read and write layer ``i``'s keys and values in ``kv_caches[i]`` from now on, by
        ``scales[i]`` in an 8-bit cache (None: 1 for every layer)."""
        ...

    def attention_layers(self) -> list[AttentionLayer]:
        """Each layer's attention as the backend sees it, in layer order."""
        ...

    def checkpoint_layout(self) -> dict[str, WeightSlot | None]:
        """Every tensor name a checkpoint of this config may hold -> its slot (None: ignored)."""
        ...

    def weights_loaded(self) -> None:
        """Called once by the loader after every slot is filled: the place to derive what the
        checkpoint stores in another form (Gemma's norms keep ``w`` of ``1 + w``)."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights and activations (the KV cache's)."""
        ...

    @property
    def device(self) -> torch.device:
        """The device the model lives on."""
        ...
