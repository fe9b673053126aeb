"""Mixture-of-experts GGUF files (``qwen3moe``, and ``llama`` with experts: Mixtral) as Conveyor's
MoE checkpoints: their config from the ``{arch}.expert_*`` metadata, their stacked expert tensors
checked and split into the per-expert tensors the model's loader reads.

llama.cpp's converter stacks each sparse layer's experts into three 3-D tensors,
``blk.N.ffn_{gate,up,down}_exps.weight`` (HF layout ``[experts, rows, columns]``), beside the
router ``blk.N.ffn_gate_inp.weight`` ``[experts, hidden]``. The families map the stacked names to
a per-expert HF name with an ``{expert}`` field (:data:`EXPERT_FIELD`); :func:`split_experts`
yields each expert's ``[rows, columns]`` matrix as a 2-D tensor of the file (its own bytes, so
an expert is dequantized or decoded alone and one held by another rank is never read). Files
converted before the experts were stacked hold one ``blk.N.ffn_gate.E.weight`` per expert
(:func:`per_expert_name`).
Torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from conveyor.checkpoints.gguf.errors import GGUFError
from conveyor.checkpoints.moe_config import EXPERT_NAMES

#: The field of a stacked tensor's HF name that :func:`split_experts` fills with the expert's index.
EXPERT_FIELD = "{expert}"
#: GGUF gating function ids (``{arch}.expert_gating_func``): only softmax is served.
_SOFTMAX = 1
#: One expert's matrix as files converted before llama.cpp stacked experts name it
#: (``blk.N.ffn_gate.E.weight``: Mixtral files of early 2024, which llama.cpp still reads).
_PER_EXPERT = re.compile(r"ffn_(gate|up|down)\.(\d+)\.weight")
_PROJECTIONS = ("gate", "up", "down")


def layer_names(architecture: str) -> dict[str, str]:
    """GGUF per-layer suffix -> HF name of the router and the stacked experts of ``architecture``."""
    module, (gate, up, down) = EXPERT_NAMES[architecture]
    experts = f"{module}.experts.{EXPERT_FIELD}"
    return {
        "ffn_gate_inp.weight": f"{module}.gate.weight",
        "ffn_gate_exps.weight": f"{experts}.{gate}.weight",
        "ffn_up_exps.weight": f"{experts}.{up}.weight",
        "ffn_down_exps.weight": f"{experts}.{down}.weight",
    }


def per_expert_name(suffix: str, architecture: str) -> str | None:
    """The HF name (within the layer) of per-expert GGUF suffix ``ffn_gate.E.weight`` ...,
    None for any other suffix."""
    match = _PER_EXPERT.fullmatch(suffix)
    if match is None:
        return None
    module, names = EXPERT_NAMES[architecture]
    return f"{module}.experts.{int(match.group(2))}.{names[_PROJECTIONS.index(match.group(1))]}.weight"


def moe_config(
    arch: str,
    architecture: str,
    get: Callable[[str], Any],
    shapes: Mapping[str, tuple[int, ...]],
    path: str | Path,
) -> dict[str, Any]:
    """The config.json keys of the experts: counts from ``{arch}.expert_count`` /
    ``expert_used_count``, their width from ``expert_feed_forward_length`` (else the
    ``feed_forward_length`` Mixtral's converter writes), ``norm_topk_prob`` from
    ``expert_weights_norm`` (absent: true, as llama.cpp computes both architectures), dense
    layers where a layer has no router; GGUFError for what Conveyor's MoE layer
    cannot compute (shared experts, a gating other than softmax, scaled
    weights). ``shapes``: every tensor's HF-order shape by GGUF name; a layer is sparse when it
    has a router (``ffn_gate_inp``)."""

    def require(key: str) -> Any:
        if (value := get(f"{arch}.{key}")) is None:
            raise GGUFError(f"{path}: metadata field {arch}.{key} is missing (a mixture-of-experts file needs it)")
        return value

    experts, used = int(require("expert_count")), int(require("expert_used_count"))
    if get(f"{arch}.expert_shared_count") or get(f"{arch}.expert_shared_feed_forward_length"):
        raise GGUFError(f"{path}: {arch}.expert_shared_count: shared experts are not supported")
    if (gating := get(f"{arch}.expert_gating_func")) not in (None, _SOFTMAX):
        raise GGUFError(f"{path}: {arch}.expert_gating_func {gating}: only softmax routing (1) is supported")
    if (scale := get(f"{arch}.expert_weights_scale")) not in (None, 1.0):
        raise GGUFError(f"{path}: {arch}.expert_weights_scale {scale}: scaled expert weights are not supported")
    width = int(get(f"{arch}.expert_feed_forward_length") or require("feed_forward_length"))
    norm = get(f"{arch}.expert_weights_norm")
    norm = True if norm is None else bool(norm)
    layers = int(require("block_count"))
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in shapes]
    if architecture == "MixtralForCausalLM":
        if not norm:
            raise GGUFError(f"{path}: {arch}.expert_weights_norm false: Mixtral always renormalizes its top-k weights")
        if dense:
            raise GGUFError(
                f"{path}: tensor blk.{dense[0]}.ffn_gate_inp.weight is missing (every Mixtral layer is sparse)"
            )
        return {"num_local_experts": experts, "num_experts_per_tok": used, "intermediate_size": width}
    return {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": width,
        "norm_topk_prob": norm,
        "mlp_only_layers": dense,
        "decoder_sparse_step": 1,
    }


def check_expert_shapes(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], path: str | Path) -> None:
    """GGUFError naming the tensor when a sparse layer's router or stacked experts (or, in an
    older file, per-expert matrices) are missing or not ``[experts, rows, columns]`` of the
    config's sizes: found before any weight is read."""
    experts = config.get("num_experts") or config["num_local_experts"]
    width = config.get("moe_intermediate_size") or config["intermediate_size"]
    hidden = config["hidden_size"]
    dense = set(config.get("mlp_only_layers") or ())
    expected = {
        "ffn_gate_inp.weight": (experts, hidden),
        "ffn_gate_exps.weight": (experts, width, hidden),
        "ffn_up_exps.weight": (experts, width, hidden),
        "ffn_down_exps.weight": (experts, hidden, width),
    }

    def check(name: str, shape: tuple[int, ...]) -> None:
        if name not in shapes:
            raise GGUFError(f"{path}: tensor {name} is missing")
        if shapes[name] != shape:
            raise GGUFError(
                f"{path}: tensor {name} has shape {shapes[name]}, expected {shape} "
                f"({experts} experts of width {width} over hidden size {hidden}, as the metadata says)"
            )

    for layer in range(config["num_hidden_layers"]):
        if layer in dense:
            continue
        for suffix, shape in expected.items():
            name = f"blk.{layer}.{suffix}"
            projection = suffix.removeprefix("ffn_").removesuffix("_exps.weight")
            if name not in shapes and f"blk.{layer}.ffn_{projection}.0.weight" in shapes:  # one per expert
                for expert in range(experts):
                    check(f"blk.{layer}.ffn_{projection}.{expert}.weight", shape[1:])
            else:
                check(name, shape)


def split_experts(tensor: Any) -> Iterator[tuple[int, Any]]:
    """(expert, its 2-D tensor) of a stacked GGUF tensor (a ``gguf`` ReaderTensor): the same
    record with expert ``e``'s rows of the data and the first two dimensions."""
    count = int(tensor.shape[-1])  # GGUF lists dimensions innermost first: the experts last
    for expert in range(count):
        data = tensor.data[expert]
        yield (
            expert,
            tensor._replace(
                name=f"{tensor.name}[{expert}]",
                shape=tensor.shape[:2].copy(),
                n_elements=tensor.n_elements // count,
                n_bytes=tensor.n_bytes // count,
                data=data,
            ),
        )
