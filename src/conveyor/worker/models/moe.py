"""The sparse MLP of a mixture-of-experts layer: a router picks each token's top-k experts,
the token's output is their SwiGLU MLPs' outputs weighted by the router.

Experts are stored stacked, one parameter for all gate/up projections and one for all down
projections (``w13`` ``[E * 2I, H]`` viewed as ``[E, 2I, H]``, ``w2`` ``[E * H, I]`` viewed as
``[E, H, I]``): the loader fills expert ``e``'s ``[I, H]`` gate rows at ``e * 2I``, its up rows
at ``e * 2I + I`` and its down rows at ``e * H`` (:meth:`SparseMoe.layout`), so per-expert
checkpoint tensors are stacked at load through the loader's ordinary row slots. Under
``--quantization`` on the CPU the two stacks are instead one quantized method per expert
(:class:`~conveyor.worker.quantization.loading.QuantizedExperts`: a GGUF file's Q8_0 / Q4_x
blocks kept as they are), filled through the same slots.

The experts run as a batch, never token by token
(:func:`conveyor.kernels.layer_ops.moe_experts`): on CUDA one fused Triton kernel pair
(:mod:`conveyor.kernels.fused_moe`: tokens sorted by expert, grouped GEMMs, no host sync, so
decode steps are captured in CUDA graphs like dense ones); elsewhere the ``T * k`` (token,
expert) pairs sorted by expert and one matmul per active expert over its token group.

Tensor parallelism (:func:`~conveyor.runtime.tensor_shards.shard_experts`): tensor-sliced,
each rank holds its share of every expert's features (the dense MLP's split, per expert);
expert-parallel, each rank holds ``E / N`` whole experts and computes only the (token, expert)
pairs routed to them. Either way every rank holds every token's hidden state (attention's
all-reduce replicated it), the router runs whole on every rank, and each rank's output is a
partial sum, so one all-reduce of ``[T, H]`` (the dense MLP's) completes the layer. An
all-to-all dispatch would only pay where ranks hold different tokens (data-parallel
attention), which Conveyor does not do: here it would move more data than the all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.kernels.layer_ops import moe_experts
from conveyor.worker.models.interface import WeightSlot
from conveyor.worker.models.layers import Linear
from conveyor.worker.parallel import TensorParallel, all_reduce_, shard_experts


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, experts)`` ``[T, top_k]`` of router ``logits`` ``[T, E]``: float32 softmax
    over all experts, the ``top_k`` largest, divided by their sum when ``renormalize``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoe(nn.Module):
    """Router ``gate`` (``[E, H]``, whole on every rank) and this rank's experts (module
    docstring: storage and the split); ``forward`` returns the all-reduced ``[T, H]`` output."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, tensor_parallel: TensorParallel
    ) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.top_k, self.renormalize = moe.top_k, moe.norm_topk_prob
        self.num_experts, self.hidden_size = moe.num_experts, config.hidden_size
        self.shard = shard_experts(moe.num_experts, moe.intermediate_size, tensor_parallel)
        self.width = self.shard.features[1] - self.shard.features[0]  # each expert's features here
        self.tensor_parallel = tensor_parallel
        self.gate = Linear(config.hidden_size, moe.num_experts, False, dtype, device)
        count, hidden = self.shard.count, config.hidden_size
        self.w13 = nn.Parameter(
            torch.empty(count * 2 * self.width, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.w2 = nn.Parameter(torch.empty(count * hidden, self.width, dtype=dtype, device=device), requires_grad=False)
        self.quantized: dict[str, object] = {}  # stack name -> its quantized experts, under --quantization

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)
        if self.quantized:  # one quantized method per expert (quantization.loading.QuantizedExperts)
            w13, w2 = self.quantized["w13"].quant, self.quantized["w2"].quant
        else:
            w13 = self.w13.view(self.shard.count, 2 * self.width, self.hidden_size)
            w2 = self.w2.view(self.shard.count, self.hidden_size, self.width)
        local = experts - self.shard.first  # other ranks' experts fall outside 0 .. count-1
        return all_reduce_(moe_experts(x, w13, w2, weights, local), self.tensor_parallel)

    def expert_stacks(self) -> dict[str, tuple[int, int, int]]:
        """``w13`` and ``w2`` as (experts held, rows per expert, input features): what a
        quantized load fills (:func:`~conveyor.worker.quantization.loading.quantize_linears`)."""
        return {
            "w13": (self.shard.count, 2 * self.width, self.hidden_size),
            "w2": (self.shard.count, self.hidden_size, self.width),
        }

    def quantize_experts(self, stack: str, target):
        """Serve stack ``stack`` (``w13`` / ``w2``) from ``target``'s per-expert quantized
        methods once loaded, its float parameter dropped; returns ``target`` (the loader's)."""
        setattr(self, stack, None)
        self.quantized[stack] = target
        return target

    def layout(
        self, theirs: str, ours: str, names: tuple[str, tuple[str, str, str]], intermediate: int
    ) -> dict[str, WeightSlot | None]:
        """Slots of layer ``theirs`` (``model.layers.N``) for this block at ``ours``
        (``layers.N.mlp``): the router whole, each held expert's gate/up rows and down columns
        of this rank's features into the stacks; experts held elsewhere are ignored (None).
        ``names``: the checkpoint's module and (gate, up, down) names; ``intermediate``: the
        checkpoint's expert width."""
        module, (gate, up, down) = names
        hidden, width, features = self.hidden_size, self.width, self.shard.features
        layout: dict[str, WeightSlot | None] = {
            f"{theirs}.{module}.gate.weight": WeightSlot(
                f"{ours}.gate.weight", 0, self.num_experts, (self.num_experts, hidden)
            )
        }
        for expert in range(self.num_experts):
            prefix = f"{theirs}.{module}.experts.{expert}"
            local = expert - self.shard.first
            if not 0 <= local < self.shard.count:
                for name in (gate, up, down):
                    layout[f"{prefix}.{name}.weight"] = None
                continue
            base = local * 2 * width
            for name, start in ((gate, base), (up, base + width)):
                layout[f"{prefix}.{name}.weight"] = WeightSlot(
                    f"{ours}.w13", start, start + width, (intermediate, hidden), rows=features
                )
            layout[f"{prefix}.{down}.weight"] = WeightSlot(
                f"{ours}.w2", local * hidden, (local + 1) * hidden, (hidden, intermediate), cols=features
            )
        return layout
