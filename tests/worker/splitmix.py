"""The unsigned splitmix64 step, the reference the sampler's counter-based noise is checked
against (its int64 ``splitmix64`` and its ``draw_keys``). Plain Python ints, masked to 64 bits
after every step, so no torch and no int64 wrapping stand between the test and the algorithm.
test_sampler.py anchors it to the published stream."""

from __future__ import annotations

U64_MASK = (1 << 64) - 1


def splitmix64_reference(value: int) -> int:
    """One splitmix64 step of ``value`` (an unsigned 64-bit int): the next state's output."""
    value = (value + 0x9E3779B97F4A7C15) & U64_MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & U64_MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & U64_MASK
    return value ^ (value >> 31)
