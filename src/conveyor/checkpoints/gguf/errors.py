"""The one error a GGUF file Conveyor cannot serve raises (every module of this package raises it)."""

from __future__ import annotations


class GGUFError(ValueError):
    """A GGUF file Conveyor cannot serve; the message names the file and the field or tensor."""
