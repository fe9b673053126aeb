"""Logits -> token ids, one row per sampling request.

Greedy rows (temperature 0) take the exact argmax of the raw logits. Other rows are
divided by their temperature, filtered (top-k, then top-p, then min-p; each disabled by
its neutral value) and sampled with the exponential race: ``argmax(p / E)`` with
``E ~ Exp(1)`` i.i.d. picks token ``i`` with probability ``p_i``, and lets every row use
its own noise without a per-row multinomial call.

Reproducibility: a seeded row's noise comes from a generator seeded by (seed, position)
alone, so its draw depends only on its own logits and not on batch mates, batch order or
an earlier preemption. Unseeded rows share the sampler's one generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from conveyor.ipc.messages import SamplingParams

_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """splitmix64 finalizer: spreads nearby integers to unrelated 64-bit values."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def step_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw at ``position`` (63 bits, as torch wants)."""
    return _mix64(_mix64(seed & _MASK64) ^ position) >> 1


class Sampler:
    """Turns float32 logits ``[N, V]`` into ``[N]`` int64 token ids on the logits' device."""

    def __init__(self, device: torch.device | str, seed: int | None = None) -> None:
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
    ) -> torch.Tensor:
        """``positions[i]`` keys row ``i``'s seeded draw: any per-request index that names this
        draw the same way every time it is made (the runner passes the sequence position of
        the token being sampled, which is the output index plus the fixed prompt length)."""
        if len(params) != logits.shape[0] or len(positions) != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logits rows, {len(params)} params, {len(positions)} positions")
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return tokens
        index = torch.tensor(rows, device=logits.device)
        tokens[index] = self._sample(logits[index], [params[i] for i in rows], [positions[i] for i in rows])
        return tokens

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
        device = logits.device
        vocab = logits.shape[-1]
        temperature = torch.tensor([p.temperature for p in params], device=device, dtype=torch.float32)
        logits = logits / temperature[:, None]

        use_top_k = any(0 < p.top_k < vocab for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        if use_top_k or use_top_p:
            # Both filters act on ranks: mask in descending order, then put tokens back in
            # vocabulary order so a row's draw never depends on whether its batch sorted.
            ranked, order = logits.sort(dim=-1, descending=True)
            if use_top_k:
                top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
                ranks = torch.arange(vocab, device=device)
                ranked = ranked.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
            if use_top_p:
                top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device)
                probs = ranked.softmax(dim=-1)
                # A token stays while the mass ranked before it is below top_p: the first always stays.
                mass_before = probs.cumsum(dim=-1) - probs
                ranked = ranked.masked_fill(mass_before >= top_p[:, None], float("-inf"))
            logits = torch.empty_like(ranked).scatter_(-1, order, ranked)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device, dtype=torch.float32)
            probs = logits.softmax(dim=-1)
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < threshold, float("-inf"))

        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        if any(p.seed is None for p in params):
            noise.exponential_(generator=self._generator)
        for i, p in enumerate(params):
            if p.seed is not None:
                generator = torch.Generator(device=device).manual_seed(step_seed(p.seed, positions[i]))
                noise[i].exponential_(generator=generator)
        # Clamp keeps a zero-probability token at score 0 even if a draw is exactly 0.
        return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
