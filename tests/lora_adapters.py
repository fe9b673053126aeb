"""Random PEFT LoRA adapters for the tiny checkpoints, saved as PEFT saves real ones.

PEFT initialises ``lora_B`` to zero, which makes an adapter a no-op whose outputs equal the
base model's: a test comparing them could not tell an adapter applied from one ignored. So
every ``lora_A`` and ``lora_B`` is redrawn non-zero here (std 0.15 / 0.3, with the alpha
scaling the adapter's output is a visible change of the greedy tokens).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base: torch.nn.Module,
    directory: Path,
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    targets: list[str] | None = None,
    rslora: bool = False,
) -> torch.nn.Module:
    """Save a random LoRA of ``base`` (an HF model, left untouched) into ``directory``;
    return the PEFT model (eval mode), the reference for greedy tokens under it."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, lora_dropout=0.0,
                        use_rslora=rslora)
    model = get_peft_model(copy.deepcopy(base), config)
    generator = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * (0.15 if "lora_A" in name else 0.3))
    model.save_pretrained(directory)
    model.base_model.model.generation_config.eos_token_id = None
    return model.eval()
