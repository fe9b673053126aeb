"""The HF transformers baselines, run in the benchmark's own process on the same checkpoint.

- ``hf``: ``model.generate`` on padded batches of ``batch_size`` requests in workload order
  (left padding, attention mask, greedy). A batch runs until its longest output is done, so
  it generates ``max(output_len)`` tokens for every row; only each request's own
  ``output_len`` count as output. A logits processor stamps every decoding step with the
  number of rows still producing useful tokens: the occupancy timeline.
- ``hf-compiled``: ``hf`` with transformers' static KV cache, whose forward transformers
  compiles on CUDA (``torch.compile``, mode ``reduce-overhead``: CUDA graphs): the strongest
  single-stream peer a stock image runs. Compilation is per shape, so its warm-up is the
  workload's first batch itself (a fixed workload's batches all share that shape); on CPU
  transformers does not compile and it is the static cache alone.
- ``hf-cb``: transformers' continuous batching, the engine behind ``generate_batch``. We
  drive its manager (``continuous_batching_context_manager`` + ``add_request``) instead of
  calling ``generate_batch`` itself because ``generate_batch`` takes one ``max_new_tokens``
  for every request and these workloads give each request its own length; the engine,
  scheduler and cache are the same. Its occupancy timeline comes from transformers' own
  per-request lifespan stamps (admitted -> finished).

EOS never ends a request early: ``min_new_tokens`` for ``hf``, ``eos_token_id=-1`` for
``hf-cb``. Both are checked to return exactly the requested lengths.

transformers has renamed the continuous-batching settings between 5.x releases (the cache's
page size was ``block_size`` and is ``page_size`` now), so ``hf-cb`` reads the names the
installed version takes from its signatures (:func:`accepted_names`) and maps each of our
settings onto the first it knows (:data:`HF_CB_FIELDS`) instead of assuming one release's
API. A setting it has no name for fails the run with a :class:`HFRunFailed` naming it,
which bin/bench reports as ``n/a`` with that reason rather than running with a setting
silently dropped.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

from conveyor_tools.bench.run_metrics import OfflineRun, Timeline
from conveyor_tools.bench.workloads import BenchRequest, Workload

HF_CB_PAGE_SIZE = 256  # transformers' default page size

# Each of our hf-cb settings -> the ContinuousBatchingConfig field names transformers has
# given it, newest first (a release that takes both, as 5.24 does with ``block_size``
# deprecated, gets the newest).
HF_CB_FIELDS: dict[str, tuple[str, ...]] = {
    "page_size": ("page_size", "block_size"),
    "num_blocks": ("num_blocks",),
    "max_batch_tokens": ("max_batch_tokens",),
    "max_requests_per_batch": ("max_requests_per_batch",),
}


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


def pretrained_source(model_dir: str) -> tuple[str, dict[str, str]]:
    """``from_pretrained``'s arguments for a checkpoint directory: a GGUF checkpoint's prepared
    directory (:mod:`conveyor.checkpoints.gguf.prepare`) loads transformers from the GGUF file
    itself, as a user of transformers would."""
    from conveyor.checkpoints.gguf.prepare import gguf_file

    source = gguf_file(model_dir)
    return (model_dir, {}) if source is None else (str(source.parent), {"gguf_file": source.name})


def load_model(model_dir: str, device: str, dtype: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    quiet_transformers()

    config = AutoConfig.from_pretrained(model_dir)
    torch_dtype = resolve_dtype(dtype, device, getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
    source, gguf = pretrained_source(model_dir)
    model = AutoModelForCausalLM.from_pretrained(source, **gguf, dtype=torch_dtype)
    return model.to(device).eval()


def run_hf_generate(
    model: Any, workload: Workload, batch_size: int, progress: Any, static_cache: bool = False
) -> OfflineRun:
    """``hf`` (``static_cache`` False) or ``hf-compiled`` (True) on ``workload``."""
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
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad,
            cache_implementation="static" if static_cache else None,
        )
        processors = LogitsProcessorList([clock] if clock is not None else [])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=config,
                logits_processor=processors,
            )
        if out.shape[1] - width != max_new:
            raise HFRunFailed(f"generate returned {out.shape[1] - width} new tokens, expected {max_new}")
        return out

    warmup = workload.requests[:batch_size] if static_cache else [BenchRequest([11, 12, 13, 14], 8)] * 2
    generate(warmup, None)  # untimed
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
    if static_cache:
        extra["compiled"] = device.type == "cuda"
    return OfflineRun.of("hf-compiled" if static_cache else "hf", workload, wall, latencies, ttfts, timeline, extra)


def _padded_tokens(workload: Workload, batch_size: int) -> int:
    """Tokens the padded batches generate in all (useful or not)."""
    reqs = workload.requests
    return sum(
        max(r.output_len for r in reqs[b : b + batch_size]) * len(reqs[b : b + batch_size])
        for b in range(0, len(reqs), batch_size)
    )


def accepted_names(target: Callable[..., Any]) -> frozenset[str]:
    """The keyword names a class (a dataclass: its init fields) or function takes explicitly.
    Names only a ``**kwargs`` would swallow do not count: such a value may be ignored."""
    if isinstance(target, type) and dataclasses.is_dataclass(target):
        return frozenset(f.name for f in dataclasses.fields(target) if f.init)
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = inspect.signature(target).parameters.values()
    return frozenset(p.name for p in params if p.kind in kinds and p.name != "self")


def _transformers_version() -> str:
    import transformers

    return f"transformers {transformers.__version__}"


def cb_config_kwargs(config_cls: type, settings: dict[str, int]) -> dict[str, int]:
    """``settings`` (keys of :data:`HF_CB_FIELDS`) under the names ``config_cls`` takes;
    :class:`HFRunFailed` naming every setting it has no name for."""
    accepted = accepted_names(config_cls)
    kwargs: dict[str, int] = {}
    missing = []
    for setting, value in settings.items():
        name = next((n for n in HF_CB_FIELDS[setting] if n in accepted), None)
        if name is None:
            missing.append(f"{setting} (tried {', '.join(HF_CB_FIELDS[setting])})")
        else:
            kwargs[name] = value
    if missing:
        raise HFRunFailed(
            f"{_transformers_version()}: {config_cls.__name__} has no field for {'; '.join(missing)}; "
            f"it takes {', '.join(sorted(accepted))}"
        )
    return kwargs


def continuous_batching_config(num_blocks: int, max_batch_tokens: int, batch_size: int) -> Any:
    """The installed transformers' ContinuousBatchingConfig with our settings, whatever it
    calls them (:func:`cb_config_kwargs`)."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError as exc:
        raise HFRunFailed(f"{_transformers_version()} has no ContinuousBatchingConfig") from exc
    settings = {
        "page_size": HF_CB_PAGE_SIZE,
        "num_blocks": num_blocks,
        "max_batch_tokens": max_batch_tokens,
        "max_requests_per_batch": batch_size,
    }
    return ContinuousBatchingConfig(**cb_config_kwargs(ContinuousBatchingConfig, settings))


def call_kwargs(target: Callable[..., Any], required: dict[str, Any], optional: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for ``target``: all of ``required`` (:class:`HFRunFailed` naming
    those it does not take) and those of ``optional`` it takes."""
    accepted = accepted_names(target)
    missing = sorted(set(required) - accepted)
    if missing:
        name = getattr(target, "__qualname__", repr(target))
        raise HFRunFailed(f"{_transformers_version()}: {name} takes no {', '.join(missing)}")
    return {**required, **{k: v for k, v in optional.items() if k in accepted}}


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
    from transformers import GenerationConfig

    reqs = workload.requests
    gen = GenerationConfig(
        do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(r.output_len for r in reqs)
    )
    dtype_bytes = torch.empty(0, dtype=model.dtype).element_size()
    num_blocks = kv_blocks_for(model, kv_cache_gib, dtype_bytes)
    cb = continuous_batching_config(num_blocks, max_batch_tokens, batch_size)
    on_cuda = model.device.type == "cuda"
    results: dict[str, Any] = {}
    latencies = [0.0] * len(reqs)
    context = model.continuous_batching_context_manager
    context_kwargs = call_kwargs(
        context,
        {"generation_config": gen, "continuous_batching_config": cb},
        {"warmup": on_cuda, "block": True, "timeout": 30},
    )
    with context(**context_kwargs) as manager:
        add_optional = set(accepted_names(manager.add_request)) & {"eos_token_id", "record_timestamps"}

        def add(ids: list[int], rid: str, max_new_tokens: int, timestamps: bool) -> None:
            optional = {"eos_token_id": -1, "record_timestamps": timestamps}  # (gen's eos_token_id is -1 too)
            extra = {k: v for k, v in optional.items() if k in add_optional}
            manager.add_request(ids, request_id=rid, max_new_tokens=max_new_tokens, **extra)

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
            add([11, 12, 13, 14], f"warmup{i}", 8, False)
        wait_for(2, lambda r: None)
        start = time.perf_counter()
        for i, r in enumerate(reqs):
            add(r.prompt_ids, f"r{i}", r.output_len, True)

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
        stamps, lifespan = getattr(out, "timestamps", None), getattr(out, "lifespan", None)
        if stamps:
            ttfts.append(stamps[0] - start)
        if lifespan:
            spans.append((lifespan[0] - start, lifespan[1] - start))
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
