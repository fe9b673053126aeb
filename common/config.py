"""Frozen configuration shared by the processes.

bin/serve builds these from its flags and hands each child the part it needs;
nothing reads environment variables behind the user's back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and mode of the batcher.

    ``max_num_batched_tokens`` is the per-iteration token budget: decodes cost one
    token each, prompts are chunked to fit what remains. ``num_blocks`` KV blocks
    of ``block_size`` tokens each form the pool; ``max_model_len`` bounds
    prompt + output of any one request.
    """

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # "continuous": iteration-level batching. "static": form a batch, run it to completion,
    # then form the next; exists only as the baseline benchmarks compare against.
    batching: str = "continuous"

    def __post_init__(self) -> None:
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
