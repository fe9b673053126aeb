#!/usr/bin/env python3
"""What loading a LoRA adapter while serving costs the step loop (a script, not a test).

A Llama-3.2-1B-shaped PEFT adapter (hidden 2048, intermediate 8192, 16 layers, 8 kv heads of
64; all seven targets, ``--rank``) is written to a temporary folder and read with
:func:`conveyor.worker.lora.read_adapter` (the worker's read: safetensors, checks, float32
copies) while a stand-in step loop runs (each step ten small matmuls on the host, one torch
thread), three ways side by side, ``--repeats`` times:

- ``none``: no read;
- ``sync``: the read between two steps, on the loop's thread (how a read between steps would stall it);
- ``thread``: the read on a thread beside the loop (conveyor.worker.lora_updates: the worker's way).

For each: the longest step, the 99th percentile step and the loop's whole time.

    python bench/lora_load.py --rank 16
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.worker.lora import read_adapter

HIDDEN, INTERMEDIATE, LAYERS, KV = 2048, 8192, 16, 512
SHAPES = {
    "q_proj": (HIDDEN, HIDDEN),
    "k_proj": (HIDDEN, KV),
    "v_proj": (HIDDEN, KV),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_proj": (HIDDEN, INTERMEDIATE),
    "up_proj": (HIDDEN, INTERMEDIATE),
    "down_proj": (INTERMEDIATE, HIDDEN),
}


def write_adapter(root: Path, rank: int) -> tuple[ModelConfig, Path]:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
    }
    (root / "config.json").write_text(json.dumps(config))
    weights = {}
    for layer in range(LAYERS):
        for target, (fan_in, fan_out) in SHAPES.items():
            module = f"base_model.model.model.layers.{layer}.{'self_attn' if target[0] in 'qkvo' else 'mlp'}.{target}"
            weights[f"{module}.lora_A.weight"] = torch.randn(rank, fan_in, dtype=torch.bfloat16)
            weights[f"{module}.lora_B.weight"] = torch.randn(fan_out, rank, dtype=torch.bfloat16)
    adapter = root / "adapter"
    adapter.mkdir()
    save_file(weights, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(SHAPES)})
    )
    return ModelConfig.from_dir(root), adapter


@contextmanager
def adapter_bench(doc: str, repeats: int) -> Iterator[tuple[argparse.Namespace, ModelConfig, Path]]:
    """A LoRA bench script's setup: its ``--rank`` / ``--repeats`` flags (``doc``'s first
    line the description), one torch thread, and :func:`write_adapter`'s adapter in a temporary
    folder for the ``with`` block: (args, the base model's config, the adapter's directory)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=repeats)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        yield args, *write_adapter(Path(tmp), args.rank)


def run(mode: str, read, steps: int = 400) -> tuple[float, float, float]:
    x, w = torch.randn(8, 256), torch.randn(256, 256)
    gaps, reader = [], None
    start = last = time.perf_counter()
    for i in range(steps):
        if i == 20 and mode == "sync":
            read()
        elif i == 20 and mode == "thread":
            reader = threading.Thread(target=read)
            reader.start()
        for _ in range(10):
            torch.relu(x @ w)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    if reader is not None:
        reader.join()
    gaps.sort()
    return gaps[-1] * 1e3, gaps[int(0.99 * len(gaps))] * 1e3, (time.perf_counter() - start) * 1e3


def main() -> None:
    with adapter_bench(__doc__, repeats=3) as (args, config, adapter):
        size = (adapter / "adapter_model.safetensors").stat().st_size / 1e6
        read = lambda: read_adapter("bench", adapter, config, args.rank)  # noqa: E731
        began = time.perf_counter()
        read()
        print(f"rank {args.rank}: {size:.1f} MB, one read alone {(time.perf_counter() - began) * 1e3:.0f} ms")
        for _ in range(args.repeats):
            print(
                "; ".join(
                    f"{mode}: longest step {a:.0f} ms, p99 {b:.1f} ms, loop {c:.0f} ms"
                    for mode in ("none", "sync", "thread")
                    for a, b, c in [run(mode, read)]
                )
            )


if __name__ == "__main__":
    main()
