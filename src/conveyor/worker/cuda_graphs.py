"""CUDA graphs of the static-buffer decode forward (embedding to logits), one per bucket.

:meth:`~conveyor.worker.decode_step.DecodeStep.forward` reads only the fixed device views of
:class:`~conveyor.worker.step_buffers.StepBuffers` and writes one fixed logits buffer, so it is
captured once per (row bucket, query tokens per row, context bound) and replayed: one launch
instead of hundreds. The graphs share one memory pool, captured largest first; bounds whose
decode-kernel plans are equal share a graph (:meth:`DecodeGraphs.bound_for`). CUDA only, with
the Triton backend, unless ``--enforce-eager``. A sleep releases them
(:meth:`~DecodeGraphs.release`: they hold the caches' and weights' addresses) and waking
captures the same keys again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterator

import torch

from conveyor.worker.step_buffers import DecodeInputs, StepBuffers, smallest_fitting

log = logging.getLogger("conveyor.worker")

#: Eager runs before a capture: compiles the Triton kernels and settles lazy allocations.
WARMUP_RUNS = 2


class DecodeGraphs:
    """Captured decode forwards; :meth:`replay` runs the one for a bucket and bound.

    ``forward(inputs, bound)`` is the runner's decode forward over the device views
    ``inputs`` with context bound ``bound``; ``query_lens`` the query tokens per row steps
    run with (1, and ``1 + k`` with speculative verify steps); ``plan_key(rows, q, bound)``
    is any hashable value equal for bounds whose kernels launch the same grids at ``rows``
    rows of ``q`` tokens.
    """

    def __init__(
        self,
        forward: Callable[[DecodeInputs, int], torch.Tensor],
        buffers: StepBuffers,
        query_lens: list[int],
        context_bounds: list[int],
        block_size: int,
        plan_key: Callable[[int, int, int], Hashable],
    ) -> None:
        self._forward = forward
        self._buffers = buffers
        self._block_size = block_size
        self._bounds = context_bounds
        # (rows, q) -> for each context bound, the bound whose graph serves it
        self._serving: dict[tuple[int, int], dict[int, int]] = {}
        for rows in buffers.buckets:
            for q in query_lens:
                serving: dict[int, int] = {}
                by_key: dict[Hashable, int] = {}
                for bound in reversed(context_bounds):
                    serving[bound] = by_key.setdefault(plan_key(rows, q, bound), bound)
                self._serving[rows, q] = serving
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self.memory_bytes = 0

    def bound_for(self, rows: int, q: int, max_seq_len: int) -> int:
        """The context bound (captured graph) a step of ``rows`` rows of ``q`` query tokens and
        this longest context (counting its ``q`` tokens) uses."""
        return self._serving[rows, q][smallest_fitting(self._bounds, max_seq_len)]

    def width(self, bound: int) -> int:
        return -(-bound // self._block_size)

    def captures(self) -> Iterator[tuple[tuple[int, int, int], DecodeInputs]]:
        """Each distinct graph's key ``(rows, q, bound)`` and its uploaded inputs (every row
        padding: a warm-up or capture writes no KV), largest first. What :meth:`capture`
        runs the forward over; a CPU test runs it over the same (no device needed here)."""
        for (rows, q), serving in sorted(self._serving.items(), reverse=True):
            for bound in sorted(set(serving.values()), reverse=True):
                width = self.width(bound)
                self._buffers.stage(rows, width, q)
                yield (rows, q, bound), self._buffers.upload(rows, width, q)

    def capture(self) -> None:
        """Capture every distinct graph, largest first, into one pool; log time and memory."""
        start = time.perf_counter()
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for key, inputs in self.captures():
            bound = key[2]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self._forward(inputs, bound)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(inputs, bound)
            self._graphs[key] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.memory_bytes = torch.cuda.memory_reserved() - reserved
        log.info(
            "captured %d decode CUDA graphs (%d row buckets up to %d, query tokens per row %s, context bounds %s) "
            "in %.2f s, holding %.1f MiB",
            len(self._graphs),
            len(self._buffers.buckets),
            self._buffers.buckets[-1],
            sorted({q for _, q in self._serving}),
            self._bounds,
            self.capture_seconds,
            self.memory_bytes / 2**20,
        )

    def release(self) -> None:
        """Drop every graph, and with the last one their pool (the memory goes back to the
        caching allocator): what a sleep frees; :meth:`capture` makes the same graphs again."""
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self.memory_bytes = 0

    def replay(self, rows: int, q: int, bound: int) -> None:
        """Run the graph of ``rows`` rows of ``q`` tokens at ``bound`` (from :meth:`bound_for`)
        on the current stream."""
        self._graphs[rows, q, bound].replay()

    def __len__(self) -> int:
        return len(self._graphs)
