"""The HF transformers baselines, run in the benchmark's own process on the same checkpoint.

- ``hf``: ``model.generate`` on padded batches of ``batch_size`` requests in workload order
  (left padding, attention mask, greedy). A batch runs until its longest output is done, so
  it generates ``max(output_len)`` tokens for every row; only each request's own
  ``output_len`` count as output. A logits processor stamps every decoding step with the
  number of rows still producing useful tokens: the occupancy timeline.
- ``hf-cb``: transformers' continuous batching, the engine behind ``generate_batch``. We
  drive its manager (``continuous_batching_context_manager`` + ``add_request``) instead of
  calling ``generate_batch`` itself because ``generate_batch`` takes one ``max_new_tokens``
  for every request and these workloads give each request its own length; the engine,
  scheduler and cache are the same. Its occupancy timeline comes from transformers' own
  per-request lifespan stamps (admitted -> finished).

EOS never ends a request early: ``min_new_tokens`` for ``hf``, ``eos_token_id=-1`` for
``hf-cb``. Both are checked to return exactly the requested lengths.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from conveyor.bench.metrics import OfflineRun, Timeline
from conveyor.bench.workloads import BenchRequest, Workload

HF_CB_PAGE_SIZE = 256  # transformers' default page size


class HFRunFailed(RuntimeError):
    pass


def resolve_dtype(dtype: str, device: str, checkpoint_dtype: Any) -> Any:
    """The rule bin/serve uses: float32 on CPU, the checkpoint's dtype on CUDA, unless named."""
    import torch

    if dtype != "auto":
        return getattr(torch, dtype)
    if device == "cpu":
        return torch.float32
    return checkpoint_dtype if checkpoint_dtype is not None else torch.bfloat16


def quiet_transformers() -> None:
    """Keep transformers' chatter out of the benchmark's own output (its table and progress
    bars): the "Loading weights" bar, warnings, and the continuous-batching engine's notices
    that psutil is missing (it would size memory we size ourselves: the cache is explicit).
    Errors other than those still show."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").addFilter(_not_about_psutil)


def _not_about_psutil(record: logging.LogRecord) -> bool:
    return "psutil" not in record.getMessage()


def load_model(model_dir: str, device: str, dtype: str) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    quiet_transformers()

    config = AutoConfig.from_pretrained(model_dir)
    torch_dtype = resolve_dtype(dtype, device, getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    return model.to(device).eval()


def run_hf_generate(model: Any, workload: Workload, batch_size: int, progress: Any) -> OfflineRun:
    import torch
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    device = model.device
    pad = 0

    class StepClock(LogitsProcessor):
        """Called once per generated position of the batch: stamps time and useful rows."""

        def __init__(self, output_lens: list[int], start: float, timeline: Timeline, first: list[float]) -> None:
            self.output_lens = output_lens
            self.start = start
            self.timeline = timeline
            self.first = first
            self.step = 0

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            now = time.perf_counter() - self.start
            if self.step == 0:
                self.first.append(now)
            self.timeline.t_s.append(now)
            self.timeline.running.append(sum(1 for n in self.output_lens if n > self.step))
            self.step += 1
            return scores

    def generate(batch: list, clock: StepClock | None) -> torch.Tensor:
        width = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - r.prompt_len :] = torch.tensor(r.prompt_ids)
            mask[row, width - r.prompt_len :] = 1
        max_new = max(r.output_len for r in batch)
        config = GenerationConfig(
            max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=pad
        )
        processors = LogitsProcessorList([clock] if clock is not None else [])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config, logits_processor=processors
            )
        if out.shape[1] - width != max_new:
            raise HFRunFailed(f"generate returned {out.shape[1] - width} new tokens, expected {max_new}")
        return out

    generate([BenchRequest([11, 12, 13, 14], 8)] * 2, None)  # warm-up, untimed
    timeline = Timeline(source="hf generate: rows of the padded batch still short of their output_len, per step")
    first_token: list[float] = []
    latencies = [0.0] * len(workload.requests)
    ttfts = [0.0] * len(workload.requests)
    start = time.perf_counter()
    for b in range(0, len(workload.requests), batch_size):
        batch = workload.requests[b : b + batch_size]
        generate(batch, StepClock([r.output_len for r in batch], start, timeline, first_token))
        done = time.perf_counter() - start
        for i in range(b, b + len(batch)):
            latencies[i] = done
            ttfts[i] = first_token[-1]
        progress.update(len(batch))
    wall = time.perf_counter() - start
    extra = {"batch_size": batch_size, "padded_output_tokens": _padded_tokens(workload, batch_size)}
    return OfflineRun.of("hf", workload, wall, latencies, ttfts, timeline, extra)


def _padded_tokens(workload: Workload, batch_size: int) -> int:
    """Tokens the padded batches generate in all (useful or not)."""
    reqs = workload.requests
    return sum(
        max(r.output_len for r in reqs[b : b + batch_size]) * len(reqs[b : b + batch_size])
        for b in range(0, len(reqs), batch_size)
    )


def kv_blocks_for(model: Any, kv_cache_gib: float, dtype_bytes: int) -> int:
    """hf-cb cache blocks (``page_size`` tokens across all layers) in ``kv_cache_gib`` GiB."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    per_token = cfg.num_hidden_layers * 2 * kv_heads * head_dim * dtype_bytes
    return max(1, int(kv_cache_gib * 2**30) // (per_token * HF_CB_PAGE_SIZE))


def run_hf_cb(
    model: Any, workload: Workload, batch_size: int, max_batch_tokens: int, kv_cache_gib: float, progress: Any
) -> OfflineRun:
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    reqs = workload.requests
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(r.output_len for r in reqs))
    dtype_bytes = torch.empty(0, dtype=model.dtype).element_size()
    num_blocks = kv_blocks_for(model, kv_cache_gib, dtype_bytes)
    cb = ContinuousBatchingConfig(
        page_size=HF_CB_PAGE_SIZE,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=batch_size,
    )
    on_cuda = model.device.type == "cuda"
    results: dict[str, Any] = {}
    latencies = [0.0] * len(reqs)
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, warmup=on_cuda, block=True, timeout=30
    ) as manager:

        def wait_for(count: int, on_result) -> None:
            got = 0
            while got < count:
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        fatal = getattr(getattr(manager, "background_thread_status", None), "fatal_error", None)
                        raise HFRunFailed(f"the transformers continuous-batching loop stopped: {fatal!r}")
                    continue
                if result.is_finished():
                    got += 1
                    on_result(result)

        for i in range(2):  # warm-up, untimed
            manager.add_request([11, 12, 13, 14], request_id=f"warmup{i}", max_new_tokens=8, eos_token_id=-1)
        wait_for(2, lambda r: None)
        start = time.perf_counter()
        for i, r in enumerate(reqs):
            manager.add_request(
                r.prompt_ids, request_id=f"r{i}", max_new_tokens=r.output_len, record_timestamps=True, eos_token_id=-1
            )

        def finished(result: Any) -> None:
            index = int(result.request_id[1:])
            latencies[index] = time.perf_counter() - start
            results[result.request_id] = result
            progress.update(1)

        wait_for(len(reqs), finished)
        wall = time.perf_counter() - start
    ttfts, spans = [], []
    for i, r in enumerate(reqs):
        out = results[f"r{i}"]
        if out.error is not None or len(out.generated_tokens) != r.output_len:
            raise HFRunFailed(
                f"hf-cb request {i}: {len(out.generated_tokens)} of {r.output_len} tokens (error: {out.error})"
            )
        if out.timestamps:
            ttfts.append(out.timestamps[0] - start)
        spans.append((out.lifespan[0] - start, out.lifespan[1] - start))
    extra = {"batch_size": batch_size, "num_blocks": num_blocks, "max_batch_tokens": max_batch_tokens}
    return OfflineRun.of("hf-cb", workload, wall, latencies, ttfts, _active_timeline(spans), extra)


def _active_timeline(spans: list[tuple[float, float]]) -> Timeline:
    """Requests between admission and finish over time: a step function at each event."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    timeline = Timeline(
        source="hf-cb: requests between admission and finish (transformers lifespan stamps)", step_function=True
    )
    running = 0
    for t, delta in events:
        running += delta
        timeline.t_s.append(max(0.0, t))
        timeline.running.append(running)
    return timeline
