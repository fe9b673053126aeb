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

    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, lora_dropout=0.0, use_rslora=rslora
    )
    model = get_peft_model(copy.deepcopy(base), config)
    generator = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * (0.15 if "lora_A" in name else 0.3))
    model.save_pretrained(directory)
    model.base_model.model.generation_config.eos_token_id = None
    return model.eval()


def spoiled_copy(adapter: Path, directory: Path, how: str) -> Path:
    """A copy of the saved ``adapter`` that no server may load: ``how`` ``"target"`` lists a
    target module the Llama family lacks in its config, ``"shape"`` cuts one ``lora_A`` to
    another base model's width. Returns ``directory``."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, directory)
    config_path, weights_path = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if how == "target":
        config = json.loads(config_path.read_text())
        config["target_modules"] = [*config["target_modules"], "fc_in"]
        config_path.write_text(json.dumps(config))
    elif how == "shape":
        weights = load_file(weights_path)
        key = next(k for k in sorted(weights) if "lora_A" in k)
        weights[key] = weights[key][:, : weights[key].shape[1] // 2].contiguous()
        save_file(weights, weights_path)
    else:
        raise ValueError(how)
    return directory
