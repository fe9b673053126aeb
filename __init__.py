"""Conveyor: an LLM serving system built around continuous batching.

Processes: ``conveyor.frontend`` (tokenizer, client socket), ``conveyor.scheduler``
(the continuous batcher), ``conveyor.worker`` (model and KV cache on the device).
Shared pieces live in ``conveyor.common``; Triton kernels in ``conveyor.kernels``.
"""

__version__ = "0.1.0"
