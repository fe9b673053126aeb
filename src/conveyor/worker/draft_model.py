"""Speculative decoding's draft model: a small checkpoint of the target's vocabulary that the
worker runs beside the target to propose the tokens a speculative row verifies
(``--speculative-method draft --speculative-model DIR``).

Its KV cache is addressed by the target's block tables and kept valid wherever the target's
is; it proposes its argmax, split over the ranks as the target is (docs/architecture.md,
"The draft model").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.runtime.model_source import draft_model_config
from conveyor.worker.attention.backend import AttentionBackend, AttentionMetadata
from conveyor.worker.attention.kv_quant import cache_dtype
from conveyor.worker.kv_cache import KVCacheShape
from conveyor.worker.kv_calibration import calibrate_kv_scales
from conveyor.worker.loader import load_model
from conveyor.worker.parallel import NO_TENSOR_PARALLEL, TensorParallel, broadcast_from_first_
from conveyor.worker.ragged_inputs import RaggedInputs
from conveyor.worker.request_state import Work


@dataclass
class Drafts:
    """One step's proposals, on the device: the speculative rows' drafted tokens laid end to
    end in row order (``counts[i]`` for the ``i``-th such row), and the draft's distribution
    each was drawn from (its logits; :attr:`probs`)."""

    tokens: torch.Tensor  # int64 [num_proposed], the same on every tensor-parallel rank
    logits: torch.Tensor | None  # float32 [num_proposed, vocab]; None off tensor-parallel rank 0
    counts: list[int]

    @property
    def probs(self) -> torch.Tensor:
        """The draft's distribution at each proposed token, float32 ``[num_proposed, vocab]``
        (on tensor-parallel rank 0, the one that holds the logits)."""
        if self.logits is None:
            raise RuntimeError("the draft's logits are on tensor-parallel rank 0 only")
        return self.logits.softmax(dim=-1)


class DraftModel:
    """The draft checkpoint loaded through the target's loader, and its KV cache (module
    docstring); under ``tensor_parallel``, this rank's shard of both. Refuses a directory that
    is no checkpoint (StartupError), whose vocabulary is not the target's or whose heads do not
    split over the ranks (ValueError), before loading a weight."""

    def __init__(
        self, model_dir: str | Path, target: ModelConfig, device: torch.device, dtype: torch.dtype,
        backend: AttentionBackend,
        block_size: int, tensor_parallel: TensorParallel = NO_TENSOR_PARALLEL, kv_cache_dtype: str = "auto",
    ) -> None:  # fmt: skip
        draft_model_config(str(model_dir), target, tensor_parallel_size=tensor_parallel.size)
        self.model, self.config = load_model(model_dir, device, dtype, backend, tensor_parallel)
        self.device = device
        self.block_size = block_size
        self.tensor_parallel = tensor_parallel
        # Its cache in the target's KV dtype, 8-bit with scales of its own.
        self.cache_shape = KVCacheShape.of(self.config, block_size, cache_dtype(kv_cache_dtype, dtype), tensor_parallel)
        self.kv_scales = calibrate_kv_scales(self.model, self.cache_shape, self.cache_shape.dtype)
        self.kv_caches: list[torch.Tensor] = []
        self.swap_caches: list[torch.Tensor] = []

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block costs in the draft's cache (its share of a block of the pool)."""
        return self.cache_shape.bytes_per_block

    def allocate(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Its cache and swap space, as many blocks as the target's."""
        self.kv_caches = self.cache_shape.allocate(num_blocks, self.device)
        self.model.bind_kv_cache(self.kv_caches, self.kv_scales)
        self.swap_caches = self.cache_shape.allocate_swap(num_cpu_blocks, self.device)

    @torch.inference_mode()
    def propose(self, work: list[Work], inputs: RaggedInputs, tables: np.ndarray) -> Drafts | None:
        """Run the step's rows (``inputs``: every row's tokens, a speculative row only its last
        known one; ``tables``: the rows' block tables) and draft each speculative row's
        ``num_drafted`` tokens greedily, batched: the ``j``-th forward feeds every row's
        ``j``-th drafted token (writing its KV) and scores the next for the rows that draft
        more. None when no row drafts (the pass only kept the KV current)."""
        hidden = self.model(inputs.tokens, inputs.positions, inputs.metadata)
        rows = np.fromiter((i for i, item in enumerate(work) if item.num_drafted), np.int64)
        if not len(rows):
            return None
        counts = np.fromiter((work[i].num_drafted for i in rows), np.int64, len(rows))
        offsets = np.cumsum(counts) - counts  # where each row's tokens start in the flat proposals
        start = np.fromiter(
            (work[i].num_computed for i in rows), np.int64, len(rows)
        )  # its last known token's position
        row_tables = tables[rows]
        tokens = torch.empty(int(counts.sum()), dtype=torch.int64, device=self.device)
        kept = None
        if self.tensor_parallel.rank == 0:
            kept = torch.empty((len(tokens), self.config.vocab_size), dtype=torch.float32, device=self.device)
        scored = hidden[self._index(inputs.ends[rows] - 1)]  # the rows whose next token is drafted
        feed = np.arange(len(rows))  # the rows drafting their j-th token
        for j in range(1, int(counts.max()) + 1):
            drawn, logits = self._draw(scored)
            at = self._index(offsets[feed] + j - 1)
            tokens[at] = drawn
            if kept is not None:
                kept[at] = logits
            positions = start[feed] + j
            metadata = AttentionMetadata.build(
                np.ones(len(feed), np.int64), positions, row_tables[feed], self.block_size, self.device
            )
            hidden = self.model(drawn, self._index(positions), metadata)
            more = np.flatnonzero(counts[feed] > j)
            if not len(more):
                break
            feed = feed[more]
            scored = hidden[self._index(more)]
        return Drafts(tokens, kept, counts.tolist())

    def _draw(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The argmax token of each row of ``hidden``, the same on every rank, and its logits
        (None off rank 0). Rank 0 alone holds the LM head: it scores and picks, then broadcasts
        the ids, which every rank feeds to its next forward (as the target's sampled ids)."""
        if self.tensor_parallel.rank == 0:
            logits = self.model.compute_logits(hidden)
            drawn = logits.argmax(dim=-1)
        else:
            logits, drawn = None, torch.empty(len(hidden), dtype=torch.int64, device=self.device)
        return broadcast_from_first_(drawn, self.tensor_parallel), logits

    def _index(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(self.device, non_blocking=True)
