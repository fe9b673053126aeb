"""What differs between the GGUF architectures Conveyor reads: one :class:`Family` each.

:mod:`.reader` maps every file the same way (``{arch}.*`` metadata -> config.json, ``blk.N.*``
tensors -> HF names); a family adds what llama.cpp's converter did differently for it or what
its metadata leaves out: q/k rows in rotary-interleaved order (Llama), tensor names of its own,
RMSNorm weights stored as ``1 + w`` (Gemma: the converter adds the 1; HF checkpoints and
Conveyor's models hold ``w``), config keys GGUF has no field for (llama.cpp hard-codes them per
architecture too: Gemma 3's local rope base, layer pattern and query scale), the tokens that
end a turn and a chat template for files that carry none, and for a mixture of experts the names
of its router and stacked experts (:mod:`.experts`; ``llama`` is Mixtral when its metadata counts
experts). Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from conveyor.checkpoints.gguf import experts

# (metadata key -> value or None) of one file.
Getter = Callable[[str], Any]


@dataclass(frozen=True)
class Family:
    """One GGUF ``general.architecture`` as Conveyor serves it."""

    architecture: str  # HF ``architectures`` entry
    model_type: str
    permuted_qk: bool = False  # q/k rows in llama.cpp's interleaved rotary order
    hidden_act: str = "silu"
    layer_names: Mapping[str, str] = field(default_factory=dict)  # GGUF per-layer suffix -> HF, over the common table
    norm_offset: float = 0.0  # subtracted from every ``*norm.weight`` tensor as read
    config: Callable[[str, Getter], dict[str, Any]] | None = None  # (arch, metadata) -> extra config.json keys
    end_of_turn: tuple[str, ...] = ()  # token texts that also end generation
    chat_template: str | None = None  # for a file without ``tokenizer.chat_template``
    experts: bool = False  # a mixture of experts: router and stacked experts (:mod:`.experts`)
    sparse: Family | None = None  # what a file of this architecture is when ``{arch}.expert_count`` is set


def _gemma3_config(arch: str, get: Getter) -> dict[str, Any]:
    """Gemma 3's config keys GGUF does not store, as llama.cpp assumes them for ``gemma3``:
    every sixth layer global, the others sliding-window with rope base 10000, scores scaled by
    ``head_dim ** -0.5`` (27B, the only 62-layer one: ``(hidden / heads) ** -0.5``)."""
    layers = int(get(f"{arch}.block_count"))
    heads = int(get(f"{arch}.attention.head_count"))
    hidden = int(get(f"{arch}.embedding_length"))
    head_dim = int(get(f"{arch}.attention.key_length") or hidden // heads)
    config: dict[str, Any] = {
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "rope_local_base_freq": float(get(f"{arch}.rope.freq_base_swa") or 10000.0),
    }
    window = get(f"{arch}.attention.sliding_window")
    if window:
        config["sliding_window"] = int(window)
        config["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):  # the latter is refused by ModelConfig
        if (value := get(f"{arch}.{key}")) is not None:
            config[key] = float(value)
    return config


# Gemma's turn format, written for this project: the system message opens the first user turn,
# the assistant speaks as "model", every turn ends with <end_of_turn> and a newline.
GEMMA_CHAT_TEMPLATE = """{{- bos_token -}}
{%- set ns = namespace(system='') -%}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set first = messages[0]['content'] -%}
  {%- set ns.system = (first if first is string else first | map(attribute='text') | join('')) | trim ~ '\\n\\n' -%}
  {%- set messages = messages[1:] -%}
{%- endif -%}
{%- for message in messages -%}
  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
  {%- set content = message['content'] if message['content'] is string
        else message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}
  {{- '<start_of_turn>' ~ role ~ '\\n' ~ (ns.system if loop.first else '') ~ content | trim ~ '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}
"""

# Mixtral: llama.cpp's converter writes it as ``llama`` (q/k permuted) with experts.
MIXTRAL = Family(
    "MixtralForCausalLM",
    "mixtral",
    permuted_qk=True,
    layer_names=experts.layer_names("MixtralForCausalLM"),
    experts=True,
)

FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "llama", permuted_qk=True, sparse=MIXTRAL),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2"),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": Family(
        "Qwen3MoeForCausalLM", "qwen3_moe", layer_names=experts.layer_names("Qwen3MoeForCausalLM"), experts=True
    ),
    "gemma3": Family(
        "Gemma3ForCausalLM",
        "gemma3_text",
        hidden_act="gelu_pytorch_tanh",
        layer_names={
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "ffn_norm.weight": "pre_feedforward_layernorm.weight",
            "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        },
        norm_offset=1.0,
        config=_gemma3_config,
        end_of_turn=("<end_of_turn>",),
        chat_template=GEMMA_CHAT_TEMPLATE,
    ),
}


def family_of_model_type(model_type: str) -> Family:
    """The family whose config.json ``model_type`` is ``model_type`` (a prepared directory's)."""
    every = [*FAMILIES.values(), *(family.sparse for family in FAMILIES.values() if family.sparse)]
    return next(family for family in every if family.model_type == model_type)
