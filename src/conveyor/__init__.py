"""Conveyor: an LLM serving system built around continuous batching.

Processes, one folder each: ``conveyor.frontend`` (tokenizer, client socket),
``conveyor.scheduler`` (the continuous batcher), ``conveyor.worker`` (model and KV cache on
the device). What they share: ``conveyor.protocol`` (the client-facing wire format),
``conveyor.ipc`` (internal messages, their codec and the transports between processes),
``conveyor.runtime`` (server config, process harness), ``conveyor.checkpoints`` (model config,
demo checkpoint), ``conveyor.profiling``. Triton kernels live in ``conveyor.kernels``; the
command-line tools in ``conveyor.cli``; bin/bench's harness in ``conveyor.bench``.
docs/architecture.md opens with the whole map.
"""

__version__ = "0.1.0"
