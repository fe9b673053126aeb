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
    prompt + output of any one request. ``num_cpu_blocks`` blocks of the same shape
    form the worker's CPU swap space (0: no swapping).

    Zero disables ``max_waiting`` and ``max_queue_time``. Times are in seconds except
    ``max_wait_ms``. docs/architecture.md describes what each knob does to a batch.
    """

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # "continuous": iteration-level batching. "static": form a batch, run it to completion,
    # then form the next; exists only as the baseline benchmarks compare against.
    batching: str = "continuous"
    # Do not start admitting for fewer than min_batch_size waiting requests unless the
    # oldest has waited max_wait_ms; running requests are never delayed by this.
    min_batch_size: int = 1
    max_wait_ms: float = 0.0
    # "fcfs": arrival order. "priority": higher AddRequest.priority first, raised by
    # aging_rate per second waited, and preempting lower-ranked running requests.
    policy: str = "fcfs"
    aging_rate: float = 1.0
    # A request that does not fit now may be passed by at most this many smaller ones.
    max_bypass: int = 32
    # What a preempted request loses: "swap" (KV to the CPU swap space), "recompute"
    # (KV dropped, prefilled again), "auto" (cheaper of the two by the cost model below).
    preemption: str = "auto"
    num_cpu_blocks: int = 0
    # Cost model of "auto": bytes of one block (all layers; 0 = unknown, swap deemed
    # free), host<->device copy bandwidth in bytes/s, and prefill throughput in tokens/s.
    block_bytes: int = 0
    swap_bandwidth: float = 16e9
    prefill_rate: float = 20000.0
    # Copy prefix-cache blocks evicted from the GPU to the CPU swap space, so a later hit
    # (a conversation's next turn) swaps them back in instead of recomputing them.
    offload_evicted: bool = False
    # Bounded queue: past max_waiting a new request is refused ("overloaded"); a request
    # not yet admitted after max_queue_time seconds fails ("timeout").
    max_waiting: int = 4096
    max_queue_time: float = 600.0
    # Recent iterations kept for the stats/profile reply.
    iteration_log_size: int = 256

    def __post_init__(self) -> None:
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.preemption not in ("swap", "recompute", "auto"):
            raise ValueError(f"preemption must be 'swap', 'recompute' or 'auto', got {self.preemption!r}")
        for name in ("num_cpu_blocks", "max_waiting", "block_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_wait_ms", "max_queue_time", "aging_rate"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.min_batch_size < 1:
            raise ValueError(f"min_batch_size must be positive, got {self.min_batch_size}")
        if self.max_bypass < 0:
            raise ValueError(f"max_bypass must be >= 0, got {self.max_bypass}")
        if self.swap_bandwidth <= 0 or self.prefill_rate <= 0:
            raise ValueError("swap_bandwidth and prefill_rate must be positive")
        if self.iteration_log_size < 1:
            raise ValueError(f"iteration_log_size must be positive, got {self.iteration_log_size}")
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
