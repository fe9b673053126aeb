"""The mixture-of-experts part of a checkpoint's config: how many experts, how many each token
takes, their width, whether the top-k weights are renormalized, which layers are sparse.

Torch-free like :mod:`.model_config` (which holds it as ``ModelConfig.moe``): bin/serve checks
that experts split over the tensor-parallel ranks, and the simulator prices expert GEMMs, from
it without torch. Qwen3-MoE and Mixtral name the same things differently; both are read here
so the model has one view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Architectures whose MLPs are mixtures of experts.
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")

#: Checkpoint names of each architecture's sparse block: its module (holding the router
#: ``gate`` and ``experts.N``) and an expert's (gate, up, down) projections.
EXPERT_NAMES: dict[str, tuple[str, tuple[str, str, str]]] = {
    "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2")),
}


@dataclass(frozen=True)
class MoeConfig:
    """Routing and sizes of the sparse layers.

    Each token's router logits (a bias-free ``[num_experts, hidden]`` projection) go through a
    float32 softmax over all experts; the ``top_k`` largest probabilities pick the experts, and
    are divided by their sum when ``norm_topk_prob`` (Mixtral always; Qwen3-MoE as its config
    says). The token's output is the weighted sum of its experts' SwiGLU MLPs of width
    ``intermediate_size``. ``sparse_layers[i]`` says whether layer ``i`` is such a layer; the
    others (Qwen3-MoE's ``mlp_only_layers``, ``decoder_sparse_step``) are dense MLPs of the
    config's ``intermediate_size``.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]


#: What transformers' config classes assume for a field config.json leaves out.
_DEFAULTS = {
    "MixtralForCausalLM": {"num_experts": 8, "num_experts_per_tok": 2},
    "Qwen3MoeForCausalLM": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
}


def parse_moe(config: dict[str, Any], architecture: str, num_layers: int) -> MoeConfig | None:
    """The MoE config of ``config.json`` contents (transformers' defaults for fields it leaves
    out), None for a dense architecture; ValueError naming the field for what cannot be served."""
    if architecture not in MOE_ARCHITECTURES:
        return None
    config = {key: value for key, value in config.items() if value is not None}
    if "num_local_experts" in config:  # (both architectures' configs accept either name)
        config.setdefault("num_experts", config["num_local_experts"])
    config = {**_DEFAULTS[architecture], **config}
    experts = config["num_experts"]
    top_k = config["num_experts_per_tok"]
    if not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {experts} experts")
    if config.get("shared_expert_intermediate_size"):
        raise ValueError(f"shared experts (shared_expert_intermediate_size) are not supported for {architecture}")
    if architecture == "MixtralForCausalLM":
        return MoeConfig(experts, top_k, config["intermediate_size"], True, (True,) * num_layers)
    dense = set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step") or 1
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return MoeConfig(experts, top_k, config["moe_intermediate_size"], bool(config.get("norm_topk_prob", False)), sparse)
