"""What Conveyor needs to know about a Hugging Face checkpoint, read from its JSON files.

Torch-free on purpose: the scheduler and bin/serve read vocabulary size, EOS ids and the
position limit without importing torch. The worker builds its model from the same object,
so every process agrees on one parsed view of ``config.json``.

Two generations of config files exist and both are accepted: transformers v5 writes
``rope_parameters`` ({rope_theta, rope_type, ...}) and ``dtype``; older checkpoints have a
top-level ``rope_theta``, an optional ``rope_scaling`` (keyed ``type`` or ``rope_type``) and
``torch_dtype``. Whatever the source, ``rope_scaling`` is normalized to ``None`` (plain RoPE)
or a dict with a ``rope_type`` key and that type's parameters, without ``rope_theta``. A model
whose sliding-window layers rotate with their own base (Gemma 3: v5's ``rope_parameters`` keyed
by layer type, or the older ``rope_local_base_freq``) has it in ``local_rope_theta`` and
``local_rope_scaling``.

Which architectures exist is :mod:`.architectures`' table; fields only one architecture's
model reads (Gemma 3's ``query_pre_attn_scalar``, soft-capping) stay in ``hf_config``, the
text config as read, so a new architecture needs no new field here unless it changes what
other processes or the KV cache must know.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.checkpoints.architectures import SUPPORTED_ARCHITECTURES, check_architecture
from conveyor.checkpoints.moe_config import MoeConfig, parse_moe

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig"]

#: Gated-MLP activation per architecture (the config's ``hidden_act``, Gemma's ``hidden_activation``).
_ACTIVATIONS = {"Gemma3ForCausalLM": "gelu_pytorch_tanh"}
#: Architectures whose config class ties the embeddings when config.json does not say.
_TIED_BY_DEFAULT = ("Gemma3ForCausalLM",)
#: Architectures with an RMSNorm per query and key head before the rotation.
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")

# rope type -> the parameters it needs (beyond rope_theta).
_ROPE_TYPE_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only checkpoint, normalized across its architectures and config generations.

    Invariants: ``num_heads % num_kv_heads == 0``; ``len(layer_types) == num_layers`` and each
    entry is ``"full_attention"`` or ``"sliding_attention"``; ``sliding_window`` is ``None``
    exactly when no layer slides. ``attention_bias`` is the q/k/v projection bias,
    ``o_proj_bias`` the output projection's (Llama and Qwen3 tie both to
    ``config.attention_bias``; Qwen2 has q/k/v bias only). ``hidden_act`` is the gated MLP's
    activation (``silu``; Gemma 3's ``gelu_pytorch_tanh``). ``local_rope_theta`` is ``None``
    unless sliding layers rotate with their own base (then ``local_rope_scaling`` is theirs).
    ``moe``: the experts of a mixture-of-experts checkpoint (:mod:`.moe_config`), else None.
    ``hf_config``: the (text) config.json as read, not compared.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    qk_norm: bool
    sliding_window: int | None
    layer_types: tuple[str, ...]
    torch_dtype: str
    eos_token_ids: list[int]
    bos_token_id: int | None
    hidden_act: str = "silu"
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    moe: MoeConfig | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Parse ``config.json`` (required) and ``generation_config.json`` (optional) in ``path``."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        config = json.loads(config_file.read_text())
        generation_file = path / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
        return cls.from_dicts(config, generation)

    @classmethod
    def from_dicts(cls, config: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        """Parse already-loaded ``config.json`` and ``generation_config.json`` contents."""
        generation = generation or {}
        architecture = _architecture(config)
        model_type = config.get("model_type", "")
        activation = _ACTIVATIONS.get(architecture, "silu")
        hidden_act = config.get("hidden_activation") or config.get("hidden_act") or activation
        if hidden_act != activation:
            raise ValueError(f"unsupported hidden_act {hidden_act!r}: {architecture} is implemented with {activation}")
        if config.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=true is not supported (a causal decoder is served)")
        if config.get("attn_logit_softcapping") is not None:
            # transformers' Gemma 3 reads this field and never applies it: no reference to match.
            raise ValueError(f"attn_logit_softcapping is not supported for {architecture}: remove it from config.json")
        if config.get("mlp_bias", False):
            raise ValueError("mlp_bias=true is not supported")

        num_layers = _required(config, "num_hidden_layers")
        num_heads = _required(config, "num_attention_heads")
        num_kv_heads = config.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        hidden_size = _required(config, "hidden_size")
        head_dim = config.get("head_dim") or hidden_size // num_heads

        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = True if is_qwen2 else bool(config.get("attention_bias", False))
        o_proj_bias = False if is_qwen2 else attention_bias

        rope_theta, rope_scaling, local_rope = _parse_rope(config)
        layer_types = _layer_types(config, architecture, num_layers)
        sliding_window = config.get("sliding_window") if SLIDING_ATTENTION in layer_types else None

        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=_required(config, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_required(config, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_required(config, "max_position_embeddings"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", architecture in _TIED_BY_DEFAULT)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            qk_norm=architecture in _QK_NORM,
            sliding_window=sliding_window,
            layer_types=layer_types,
            torch_dtype=config.get("dtype") or config.get("torch_dtype") or "float32",
            eos_token_ids=_union_ids(config.get("eos_token_id"), generation.get("eos_token_id")),
            bos_token_id=config.get("bos_token_id", generation.get("bos_token_id")),
            hidden_act=hidden_act,
            local_rope_theta=local_rope[0] if local_rope else None,
            local_rope_scaling=local_rope[1] if local_rope else None,
            moe=parse_moe(config, architecture, num_layers),
            hf_config=dict(config),
        )

    def layer_sliding_window(self, layer: int) -> int | None:
        """The attention window of ``layer`` in tokens (the query included), ``None`` for full attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    def layer_rope(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """``(theta, scaling)`` of ``layer``'s rotary embedding: the local ones for a sliding
        layer of a model that has them, else ``rope_theta`` and ``rope_scaling``."""
        if self.layer_types[layer] == SLIDING_ATTENTION and self.local_rope_theta is not None:
            return self.local_rope_theta, self.local_rope_scaling
        return self.rope_theta, self.rope_scaling


def _required(config: dict[str, Any], key: str) -> Any:
    if key not in config or config[key] is None:
        raise ValueError(f"config.json lacks required field {key!r}")
    return config[key]


def _architecture(config: dict[str, Any]) -> str:
    architectures = config.get("architectures") or []
    if len(architectures) != 1:
        raise ValueError(f"config.json must name exactly one architecture, got {architectures!r}")
    return check_architecture(architectures[0])


def _parse_rope(
    config: dict[str, Any],
) -> tuple[float, dict[str, Any] | None, tuple[float, dict[str, Any] | None] | None]:
    """(rope_theta, normalized rope_scaling, the sliding layers' own (theta, scaling) or None)
    from either config generation."""
    parameters = config.get("rope_parameters")
    local = None
    if parameters and any(isinstance(value, dict) for value in parameters.values()):
        unknown = set(parameters) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise ValueError(f"rope_parameters has unknown layer types {sorted(unknown)}")
        full = dict(parameters.get(FULL_ATTENTION) or {})
        if SLIDING_ATTENTION in parameters:
            local = _normalize_rope(dict(parameters[SLIDING_ATTENTION] or {}), 10000.0)
        return (*_normalize_rope(full, config.get("rope_theta", 10000.0)), local)
    scaling = dict(parameters) if parameters else dict(config.get("rope_scaling") or {})
    if "rope_local_base_freq" in config:  # Gemma 3 before transformers v5: local layers unscaled
        local = (float(config["rope_local_base_freq"]), None)
    return (*_normalize_rope(scaling, config.get("rope_theta", 10000.0)), local)


def _normalize_rope(scaling: dict[str, Any], default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling without theta or None) of one rope parameter dict; its type checked."""
    theta = float(scaling.pop("rope_theta", default_theta))
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return theta, None
    if rope_type not in _ROPE_TYPE_KEYS:
        supported = ", ".join(["default", *_ROPE_TYPE_KEYS])
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {supported}")
    missing = [key for key in _ROPE_TYPE_KEYS[rope_type] if key not in scaling]
    if missing:
        raise ValueError(f"rope type {rope_type!r} lacks {', '.join(missing)}")
    return theta, {"rope_type": rope_type, **scaling}


def _layer_types(config: dict[str, Any], architecture: str, num_layers: int) -> tuple[str, ...]:
    """Which layers use sliding-window attention, the way transformers decides it.

    Mistral and Mixtral slide in every layer when they have a window, Qwen3-MoE too when
    ``use_sliding_window`` is set. Qwen2/Qwen3 slide only with ``use_sliding_window`` and a
    window: in the layers an explicit ``layer_types`` marks, or else from layer
    ``max_window_layers`` on. Llama never slides.
    """
    window = config.get("sliding_window")
    explicit = config.get("layer_types")
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        types = [SLIDING_ATTENTION if window else FULL_ATTENTION] * num_layers
    elif architecture == "Qwen3MoeForCausalLM":
        types = [SLIDING_ATTENTION if window and config.get("use_sliding_window") else FULL_ATTENTION] * num_layers
    elif architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not (config.get("use_sliding_window", False) and window):
            types = [FULL_ATTENTION] * num_layers
        elif explicit is not None:
            types = list(explicit)
        else:
            start = config.get("max_window_layers", num_layers)
            types = [SLIDING_ATTENTION if i >= start else FULL_ATTENTION for i in range(num_layers)]
    elif architecture == "Gemma3ForCausalLM":
        if explicit is not None:
            types = list(explicit)
        else:
            pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
            types = [FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(num_layers)]
        if SLIDING_ATTENTION in types and not window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
    else:
        types = [FULL_ATTENTION] * num_layers
    if len(types) != num_layers or set(types) - {FULL_ATTENTION, SLIDING_ATTENTION}:
        kinds = f"{FULL_ATTENTION!r}/{SLIDING_ATTENTION!r}"
        raise ValueError(f"layer_types must list {num_layers} of {kinds}, got {types!r}")
    return tuple(types)


def _union_ids(*sources: int | list[int] | None) -> list[int]:
    """Ids from each source (an int, a list or None), first occurrence order, no repeats."""
    ids: list[int] = []
    for source in sources:
        for token in [source] if isinstance(source, int) else source or []:
            if token not in ids:
                ids.append(token)
    return ids
