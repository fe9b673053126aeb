"""The copy checkpoint of the speculative-decoding benchmark, and its two workloads.

Speculative decoding pays off by how often proposals are right, which a random model never
makes them; the benchmark needs a model whose greedy output it can predict, at the demo
model's exact cost. This is the demo checkpoint (same architecture, tokenizer and random
q/k/v/gate/up weights, so every forward does the same work) with an **exact weight
construction** on top, no training:

- every layer's ``o_proj`` and ``down_proj`` is zero, so the residual stream after the last
  layer is still the token's embedding (the attention and MLP still run, and cost the same);
- the embeddings are seeded Gaussian rows (unit variance per entry) and ``lm_head`` row
  ``successor[x]`` is embedding row ``x``: the logits of token ``x`` peak at ``successor[x]``
  (its own squared norm, about ``hidden``, against dot products with the other rows of
  spread ``sqrt(hidden)``; :func:`copy_weights` checks the argmax of every token).

``successor`` is a permutation of the vocabulary made of cycles of :data:`CYCLE_LEN` tokens,
so greedy decoding walks a cycle. Workloads (prompt ``CYCLE_LEN`` tokens, outputs shorter):

- ``copy``: the prompt is a stretch of a cycle, so it holds the passage the output repeats;
  the n-gram proposer's lookups hit and every proposed token is accepted.
- ``mispredict``: the prompt is a cycle's tokens shuffled. Every output token occurs in the
  prompt, so every lookup hits, but what followed it there is a random token of the cycle:
  proposals are made every step and (but for about 1 in ``CYCLE_LEN``) rejected, the worst
  case of verification cost. Outputs stay shorter than a cycle, so the output never repeats
  itself (which would let the proposer learn it).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from conveyor.checkpoints.demo.checkpoint import (
    cached_checkpoint_dir,
    demo_config,
    demo_fingerprint,
    demo_weights,
    write_demo_checkpoint,
)
from conveyor_tools.bench.workloads import BenchRequest, Workload

CYCLE_LEN = 128
COPY_SEED = 1
FORMAT_VERSION = 1
COPY_WORKLOADS = ("copy", "mispredict")


def successor(vocab_size: int, cycle_len: int = CYCLE_LEN, seed: int = COPY_SEED) -> np.ndarray:
    """``successor[x]``: the copy model's greedy token after ``x``. A seeded shuffle of the
    vocabulary cut into cycles of ``cycle_len`` (the last one shorter if it does not divide)."""
    order = np.random.default_rng(seed).permutation(vocab_size)
    succ = np.empty(vocab_size, np.int64)
    for start in range(0, vocab_size, cycle_len):
        cycle = order[start : start + cycle_len]
        succ[cycle] = np.roll(cycle, -1)
    return succ


def copy_weights(config: dict, seed: int = COPY_SEED) -> dict[str, np.ndarray]:
    """The demo model's weights with the construction of the module docstring; checks that
    greedy decoding follows :func:`successor` from every token."""
    weights = demo_weights(config, seed)
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor[:] = 0
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    embed = np.random.default_rng(seed + 1).standard_normal((vocab, hidden), dtype=np.float32)
    succ = successor(vocab, seed=seed)
    head = np.empty_like(embed)
    head[succ] = embed
    greedy = (embed @ head.T).argmax(axis=1)  # the final RMSNorm (unit weight) only scales a row
    if not np.array_equal(greedy, succ):
        raise AssertionError(f"copy model: {int((greedy != succ).sum())} tokens miss their successor")
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head
    return weights


def copy_checkpoint_dir() -> Path:
    """The copy checkpoint in the cache beside the demo one, built on first use (seconds)."""
    params = f"{demo_fingerprint()}:{FORMAT_VERSION}:{CYCLE_LEN}:{COPY_SEED}"
    name = "copy-" + hashlib.sha256(params.encode()).hexdigest()[:12]
    return cached_checkpoint_dir(name, lambda path: write_demo_checkpoint(path, weights=copy_weights(demo_config())))


def copy_workload(
    name: str, num_requests: int, vocab_size: int, output_len: int, seed: int = 0, prompt_len: int = CYCLE_LEN
) -> Workload:
    """``num_requests`` prompts of the ``copy`` or ``mispredict`` workload (module docstring),
    each on a cycle of the copy model drawn at random, each asking for ``output_len`` tokens
    (below ``CYCLE_LEN`` for ``mispredict``)."""
    if name not in COPY_WORKLOADS:
        raise ValueError(f"unknown copy-model workload {name!r}; choose from {', '.join(COPY_WORKLOADS)}")
    if name == "mispredict" and not (output_len < CYCLE_LEN and prompt_len == CYCLE_LEN):
        raise ValueError(f"mispredict needs prompts of {CYCLE_LEN} tokens and fewer outputs")
    succ = successor(vocab_size)
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num_requests):
        token = int(rng.integers(vocab_size))
        walk = [token]
        while len(walk) < prompt_len:
            walk.append(int(succ[walk[-1]]))
        prompt = walk if name == "copy" else [int(t) for t in rng.permutation(walk)]
        requests.append(BenchRequest(prompt, output_len))
    params = {"cycle_len": CYCLE_LEN, "prompt_len": prompt_len, "output_len": output_len}
    return Workload(name, seed, requests, params)
