"""The decode-step roofline beside the measured decode steps of a served run (bin/bench offline).

A decode step must read every weight once (the LM head's too: each step's logits need the
whole ``[vocab, hidden]`` matrix) and each sequence's keys and values so far; at small batch
nothing else comes close, so its time is bounded below by those bytes over the machine's
memory bandwidth. That bound is computed the way ``bench/decode_step.py`` computes the GPU's:
weight bytes + KV bytes of the step over the bandwidth of one large copy (read + write
counted). Here the copy is a numpy copy of :data:`COPY_BYTES` (well past any CPU cache), best
of :data:`COPY_REPEATS`, in the benchmark's own process before the servers start.

The measured side is the worker's own per-step record (``extra.step_records``: each step's
decode rows, context tokens and busy time, behind ``--profile``): the decode-only steps
(no prefill token) are grouped by batch size and each group's median busy time is set beside
its median roofline. A machine shared with other work shows both a lower bandwidth and
slower steps: the ratio is only as steady as the machine.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any

import numpy as np

from conveyor.checkpoints.model_config import ModelConfig

COPY_BYTES = 256 << 20
COPY_REPEATS = 5
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = COPY_REPEATS) -> float:
    """Bytes/s of a large memory copy, read + write counted (best of ``repeats``)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def weight_bytes(config: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of every parameter of a Llama-family model (a tied LM head counted once)."""
    hidden, heads = config.hidden_size, config.head_dim
    q, kv = config.num_heads * heads, config.num_kv_heads * heads
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * config.intermediate_size + 2 * hidden
    if config.attention_bias:
        per_layer += q + 2 * kv
    if config.qk_norm:
        per_layer += 2 * heads
    embeddings = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    return dtype_bytes * (config.num_layers * per_layer + embeddings + hidden)


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of one token's keys and values over all layers."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes


def dtype_bytes_of(dtype: str, device: str, config: ModelConfig) -> int:
    """Bytes per weight for bin/serve's ``--dtype`` rule (auto: float32 on CPU, else the checkpoint's)."""
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else (config.torch_dtype or "float32")
    return DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 4)


def decode_roofline(
    step_records: dict[str, list[float]], config: ModelConfig, dtype_bytes: int, bandwidth: float
) -> list[dict[str, Any]]:
    """One row per decode batch size seen in ``step_records``: steps, median context tokens,
    median measured busy ms, median roofline ms and their ratio (measured / roofline)."""
    weights = weight_bytes(config, dtype_bytes)
    per_token = kv_bytes_per_token(config, dtype_bytes)
    groups: dict[int, list[tuple[float, float]]] = defaultdict(list)
    columns = zip(
        step_records.get("step_prefill_tokens", []),
        step_records.get("step_decode_seqs", []),
        step_records.get("step_context_tokens", []),
        step_records.get("step_time", []),
    )
    for prefill, decodes, context, busy_ms in columns:
        if prefill == 0 and decodes > 0:
            groups[int(decodes)].append((float(context), float(busy_ms)))
    rows = []
    for batch in sorted(groups):
        contexts, times = zip(*groups[batch])
        context = statistics.median(contexts)
        roofline_ms = 1e3 * (weights + context * per_token) / bandwidth
        measured_ms = statistics.median(times)
        rows.append(
            {
                "batch": batch,
                "steps": len(times),
                "context_tokens": context,
                "measured_ms": measured_ms,
                "roofline_ms": roofline_ms,
                "ratio": measured_ms / roofline_ms,
            }
        )
    return rows


def roofline_table(name: str, rows: list[dict[str, Any]], bandwidth: float) -> str:
    """The rows as text under a line naming the system and the bandwidth they assume."""
    lines = [f"{name}: decode steps beside the roofline (copy bandwidth {bandwidth / 1e9:.1f} GB/s, read + write)"]
    lines.append(f"  {'batch':>5} {'steps':>6} {'context':>8} {'step ms':>9} {'roofline ms':>11} {'ratio':>6}")
    for r in rows:
        lines.append(
            f"  {r['batch']:>5} {r['steps']:>6} {r['context_tokens']:>8.0f} {r['measured_ms']:>9.2f} "
            f"{r['roofline_ms']:>11.2f} {r['ratio']:>6.2f}"
        )
    return "\n".join(lines)
