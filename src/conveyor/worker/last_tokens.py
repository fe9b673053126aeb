"""The last token of each slot, on the device: a step's input the host may not have read yet.

A step can be launched before the one before it has finished, so a decode row's input may be
a token only the device has seen: every step scatters its samples here, and a launch reads a
row's last token from here when the host's copy lacks it."""

from __future__ import annotations

import torch


class LastTokens:
    """``tokens[slot]``: the slot's last token, int64 on ``device``, grown with the slot table."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tokens = torch.zeros(0, dtype=torch.int64, device=device)

    def cover(self, num_slots: int) -> None:
        """Room for slots ``0 .. num_slots - 1``."""
        if len(self.tokens) < num_slots:
            grown = torch.zeros(num_slots, dtype=torch.int64, device=self.device)
            grown[: len(self.tokens)] = self.tokens
            self.tokens = grown

    def scatter(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        """The step's samples (device tensors), without a host round trip."""
        self.tokens.index_copy_(0, slots, sampled)

    def set(self, slot: int, token: int) -> None:
        with torch.inference_mode():
            self.tokens[slot] = token
