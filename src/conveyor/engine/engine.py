"""The in-process engine: bin/serve's scheduler and model runner in one process, no sockets.

:class:`Engine` builds the pieces bin/serve starts through the same functions and reads every
request through the frontend's request processor (:mod:`conveyor.frontend.processor`), so a
request gets the same tokens, text and errors as through bin/serve. How a step, ids,
continuations and tensor parallelism work here: docs/architecture.md, "conveyor.Engine".
:meth:`Engine.embed` (embeddings: prompt-only pooling requests) is :mod:`conveyor.engine.embeddings`'s."""

from __future__ import annotations

import itertools
import os
import time
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from conveyor.assembly.build import batcher_config, settings_view, worker_settings
from conveyor.checkpoints.model_config import ModelConfig
from conveyor.engine.embeddings import embed
from conveyor.engine.options import EngineOptions
from conveyor.engine.outputs import BatchInfo, Result, StepOutput
from conveyor.engine.ranks import RankGroup, RanksFailed
from conveyor.engine.request import Request
from conveyor.frontend.constraints import ConstraintCompiler
from conveyor.frontend.output import best_of, cumulative_logprob, merge
from conveyor.frontend.processor import RequestProcessor
from conveyor.frontend.sessions import Sessions
from conveyor.frontend.tokenizer import Tokenizer
from conveyor.ipc.messages import (
    AddRequest,
    CommitLora,
    FinishReason,
    LoadLora,
    RequestOutput,
    SleepEngine,
    StepPlan,
    StepResult,
    UnloadLora,
    UpdateWeights,
    WakeEngine,
    WeightGroup,
    speculation_rates,
)
from conveyor.protocol import requests as client_requests
from conveyor.protocol import wire
from conveyor.runtime.config import RunnerConfig, SchedulerConfig
from conveyor.runtime.model_source import draft_model_config, model_length, resolve_model
from conveyor.runtime.tensor_shards import NO_TENSOR_PARALLEL, check_shardable
from conveyor.scheduler.scheduler import Scheduler
from conveyor.worker.engine_control import EngineControl, weight_specs, weight_specs_of
from conveyor.worker.main import build_runner, failed_step, pool_agreed_by_ranks, worker_threads
from conveyor.worker.plan_check import PlanRefused
from conveyor.worker.weight_updates import WeightBroadcast, check_update

# add_request's keyword arguments besides the input, the id and the priority: the generate
# fields a client passes as options.
_OPTIONS = frozenset(client_requests.OPTION_FIELDS) - {"priority"}


class Engine:
    """bin/serve's batching engine as a library: add requests, step, read their tokens and text.

    ``model``: as bin/serve's ``--model`` (:func:`~conveyor.runtime.model_source.resolve_model`;
    None: SmolLM2-135M-Instruct). ``config``: bin/serve's settings by name (:mod:`conveyor.engine.options`):
    ``device``, ``dtype``, ``attention``, ``num_kv_blocks`` or ``kv_cache_memory`` (GiB),
    ``max_model_len``, ``max_sessions``, ... and every scheduler knob by its
    :class:`~conveyor.runtime.config.SchedulerConfig` name, with TGI's ``max_batch_size``
    (``max_num_seqs``) and ``max_batch_tokens`` (``max_num_batched_tokens``).
    ``tensor_parallel_size``: the model split over that many ranks, as bin/serve's (module
    docstring); ``distributed_timeout_s`` bounds their start-up and every collective. A
    context manager: :meth:`close` at the end.
    """

    def __init__(self, model: str | os.PathLike | None = None, **config: Any) -> None:
        options = EngineOptions.from_kwargs(config)
        model_dir, self.demo = resolve_model(None if model is None else os.fspath(model))
        self.model_dir = model_dir
        self.model_config = ModelConfig.from_dir(model_dir)
        self.max_model_len = model_length(self.model_config, options.max_model_len)
        settings = options.settings()
        batcher = batcher_config(settings, self.max_model_len)  # bad knobs fail before the model loads
        size = options.tensor_parallel_size
        if batcher.speculative_model is not None:
            draft_model_config(batcher.speculative_model, self.model_config, self.max_model_len, size)
        check_shardable(self.model_config, size, f"model {model_dir}", options.expert_parallel)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self._constraints = ConstraintCompiler(model_dir)
        worker = worker_settings(settings)
        runner_config = settings_view(
            RunnerConfig, worker, model_dir=model_dir, num_threads=worker_threads(worker["num_threads"], size)
        )
        self._ranks = RankGroup(worker, model_dir) if size > 1 else None
        self._close_ranks = None if self._ranks is None else weakref.finalize(self, self._ranks.close)
        self._recoverable = Exception if size == 1 else PlanRefused  # (docs/architecture.md, "conveyor.Engine")
        tp = NO_TENSOR_PARALLEL if self._ranks is None else self._ranks.tp
        try:
            self.runner = runner = build_runner(runner_config, tensor_parallel=tp)
            num_blocks, num_cpu_blocks = pool_agreed_by_ranks(runner, tp)
            if self._ranks is not None:
                self._ranks.wait_ready()
        except BaseException as exc:
            cause = None if self._ranks is None or isinstance(exc, RanksFailed) else self._ranks.start_failure()
            self.close()
            if cause is not None:
                raise cause from exc
            raise
        batcher = replace(batcher, num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, block_bytes=runner.block_bytes)
        self.scheduler = Scheduler(batcher, self.model_config.eos_token_ids, self.model_config.vocab_size)
        self._sessions = Sessions(options.max_sessions)
        self.processor = RequestProcessor(
            self.tokenizer,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            max_logprobs=options.max_logprobs,
        )
        self.weight_version = 0  # bumped by each weight update (every request reports the one it ran on)
        self._control = EngineControl(self.runner)  # weight updates, sleep and wake (every rank alike)
        self._scheduler_ids = itertools.count(1)
        self._lora_queries = itertools.count(1)  # (LoRA updates sent to tensor-parallel ranks)
        self._running: dict[str, Request] = {}  # by scheduler id: every request not done
        self._by_id: dict[str, Request] = {}  # the same, by the caller's id
        # The last request under each id that is not removed (held by the caller: a request
        # nobody holds cannot be removed; its context stays in the sessions until evicted).
        self._latest: weakref.WeakValueDictionary[str, Request] = weakref.WeakValueDictionary()

    def close(self) -> None:
        """Stop the tensor-parallel ranks and release what they hold (nothing to do with one
        rank); idempotent. Stepping a closed tensor-parallel engine raises RanksFailed."""
        if self._close_ranks is not None:
            self._close_ranks()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def config(self) -> SchedulerConfig:
        """The scheduler's :class:`~conveyor.runtime.config.SchedulerConfig` (the KV pool sized)."""
        return self.scheduler.config

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        **sampling: Any,
    ) -> Request:
        """Queue a request; it runs from the next :meth:`step` on.

        Exactly one input: ``prompt`` (text, tokenized with BOS), ``token_ids`` or chat
        ``messages`` (the checkpoint's chat template). ``sampling``: the generate fields of
        docs/protocol.md (``max_tokens`` (16), ``temperature`` (1.0), ``top_p``, ``top_k``,
        ``min_p``, ``seed``, ``stop_token_ids``, ``ignore_eos``, ``speculate``, ``stop``: stop strings, the
        frontend fields ``fill_context``, ``truncate_prompt_tokens``, ``skip_special_tokens``,
        ``include_stop_str_in_output``, ``add_generation_prompt``, ``continue_final_message``,
        ``chat_template_kwargs``), ``n`` > 1 (at most 64: ``n`` sequences of the prompt, sharing
        its KV, sequence i with ``seed + i``, in :attr:`Request.outputs`; not with
        log-probabilities or a constraint yet), ``logprobs`` / ``prompt_logprobs`` (the number of top
        log-probabilities, up to ``max_logprobs`` (20), read from :attr:`Request.logprobs` /
        ``prompt_logprobs``), and structured output: ``constraint`` (docs/protocol.md),
        ``tools`` and ``tool_choice``. ``lora`` names the LoRA adapter to generate with (one
        of the options' ``lora_modules``, or one added by :meth:`load_lora`).
        ``priority`` counts under ``policy="priority"``. A ``request_id`` of a finished request
        that was not removed continues it (docs/architecture.md, "conveyor.Engine").

        Raises ValueError (a :class:`~conveyor.protocol.wire.ProtocolError`) with the
        server's own message when the request cannot be served: a bad field, an id still in
        flight, a prompt too long for the model, a full queue.
        """
        unknown = sorted(set(sampling) - _OPTIONS)
        if unknown:
            raise TypeError(f"add_request() got unexpected keyword argument(s): {', '.join(unknown)}")
        if self._control.sleep is not None:
            raise ValueError("the engine is asleep: wake_up() first")
        if token_ids is not None and not isinstance(token_ids, list):
            token_ids = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
        fields = {
            "type": wire.GENERATE,
            "request_id": request_id,
            "prompt": prompt,
            "messages": messages,
            "token_ids": token_ids,
            "priority": priority,
            **sampling,
        }
        req = client_requests.parse_client_message(fields)
        rid = req.request_id
        if rid in self._by_id:
            raise wire.ProtocolError(f"request id {rid!r} is already in flight", rid)
        history = self._sessions.context(rid)
        self.processor.check(req, len(history or ()))  # before compiling or tokenizing
        self._constraints.compile(req)  # a bad constraint is refused before anything is queued
        prompt_ids = self.processor.prompt(req, history).prompt_ids
        scheduler_id = str(next(self._scheduler_ids))
        arrival = time.time()
        rejected = self.scheduler.add_request(
            AddRequest(scheduler_id, prompt_ids, req.sampling, arrival, req.priority, lora=req.lora)
        )
        if rejected is not None:
            raise wire.ProtocolError(rejected.error, rid)
        if history is not None:
            self._sessions.take(rid)  # back, extended, when this turn ends
        history_len = len(history) if history is not None else 0
        prompt_log = self.processor.prompt_log(req)
        request = Request(
            self,
            rid,
            scheduler_id,
            prompt_ids,
            history_len,
            self.processor.streams(req, prompt_ids),
            arrival,
            prompt_log,
        )
        request._keep_best = req.keep_best
        request.weight_version = self.weight_version
        for i, (seq_id, streams) in enumerate(self.processor.fork(req, prompt_ids, scheduler_id)):
            # Its own output log (best_of > n: what ranks it at the end); the request's prompt log.
            seq = Request(
                self, rid, seq_id, prompt_ids, history_len, streams, arrival, prompt_log, index=i, parent=request
            )
            request.sequences.append(seq)
        for seq in request.outputs:
            self._running[seq._scheduler_id] = seq
        self._by_id[rid] = request
        self._latest[rid] = request
        return request

    def load_lora(self, name: str, directory: str | os.PathLike) -> None:
        """Register the PEFT LoRA adapter in ``directory`` under ``name`` while serving (the
        engine must have LoRA on: ``lora_modules`` or ``enable_lora``). Requests may name it
        from now on. Raises :class:`~conveyor.worker.lora.LoraLoadError` (a ValueError) naming
        what is wrong with it, changing nothing: the engine serves on."""
        if self._ranks is not None:  # every rank reads it, then registers it or agrees it cannot
            query_id = f"engine-lora-{next(self._lora_queries)}"
            self._ranks.send(LoadLora(query_id, name, str(directory)))
            self._ranks.send(CommitLora(query_id))
        self.runner.adapters.load_lora(name, str(directory))
        self.scheduler.add_lora(name)

    def unload_lora(self, name: str) -> None:
        """Forget adapter ``name``; ValueError if it is unknown or a live request uses it. Its
        prefix-cache blocks are never found again, also if a new adapter takes the name."""
        if self.runner.lora is None:
            raise ValueError("LoRA is off: start the engine with lora_modules or enable_lora=True")
        self.scheduler.remove_lora(name)
        if self._ranks is not None:
            self._ranks.send(UnloadLora(f"engine-lora-{next(self._lora_queries)}", name))
        self.runner.adapters.unload_lora(name)

    # ------------------------------------------------------------------ RL rollouts

    def update_weights(self, source: Any, *, in_flight: str = "finish") -> int:
        """Load new weights in place and return the new :attr:`weight_version`. ``source``: a
        checkpoint directory (or GGUF file's directory), ``(name, tensor)`` pairs (a mapping
        too) in checkpoint names, or a :class:`~conveyor.worker.weight_updates.WeightBroadcast`
        (the trainer's group; under tensor parallelism rank r joins it as ``source.rank + r``).
        Requests in flight first ``finish`` on the old weights, or are ``abort``-ed; the prefix
        cache is dropped. A bad update is refused whole (ValueError; every rank keeps its
        weights). Every rank loads its own shard (:mod:`conveyor.worker.engine_control`)."""
        tensors = None
        if isinstance(source, (str, os.PathLike)):
            msg = UpdateWeights(self._control_id(), path=os.fspath(source))
        elif isinstance(source, WeightBroadcast):
            specs = weight_specs_of(source.specs)
            group = WeightGroup(source.address, source.rank, source.world_size, specs, source.timeout_s)
            msg = UpdateWeights(self._control_id(), group=group)
        else:
            tensors = list(source.items() if hasattr(source, "items") else source)
            if len({name for name, _ in tensors}) != len(tensors):
                raise ValueError("weight update from tensors refused, the model is unchanged: a weight is named twice")
            check_update(self.runner.model, {name: tuple(t.shape) for name, t in tensors}, "tensors")
            msg = UpdateWeights(self._control_id(), from_rank0=weight_specs(tensors))
        if self._control.sleep is not None:
            raise ValueError("the weights cannot be updated while asleep: wake_up first")
        self._between_requests(in_flight, "weights updated")
        self._on_every_rank(msg, tensors)
        self.scheduler.drop_prefix_cache()
        self.weight_version += 1
        return self.weight_version

    def sleep(self, level: int = 1, *, in_flight: str = "finish") -> int:
        """Free the KV cache (level 1) and the weights too (level 2, read again from the model
        directory on :meth:`wake_up`); returns the bytes freed (rank 0's). Requests in flight
        ``finish`` or are ``abort``-ed first; :meth:`add_request` refuses while asleep."""
        if self._control.sleep is not None:
            raise ValueError(f"the engine is already asleep (level {self._control.sleep.level})")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (the KV cache) or 2 (the KV cache and the weights), got {level}")
        self._between_requests(in_flight, "engine put to sleep")
        answer = self._on_every_rank(SleepEngine(self._control_id(), level))
        self.scheduler.drop_prefix_cache()
        return answer.freed_bytes

    def wake_up(self) -> None:
        """Take back what :meth:`sleep` freed (a level-2 sleep reloads the checkpoint's weights:
        a new :attr:`weight_version`)."""
        if self._control.sleep is None:
            return
        level = self._control.sleep.level
        self._on_every_rank(WakeEngine(self._control_id()))
        self.weight_version += level == 2

    @property
    def is_sleeping(self) -> bool:
        return self._control.sleep is not None

    def _control_id(self) -> str:
        return f"engine-control-{next(self._lora_queries)}"

    def _on_every_rank(self, msg: UpdateWeights | SleepEngine | WakeEngine, tensors=None):
        """Apply ``msg`` on every rank (the others read it on the plan channel, between the same
        two steps); ValueError with rank 0's reason if it was refused."""
        if self._ranks is not None:
            self._ranks.send(msg)
        answer = self._control.apply(msg, tensors)
        if not answer.ok:
            raise ValueError(answer.error)
        return answer

    def _between_requests(self, in_flight: str, why: str) -> None:
        """End every request in flight: run them to their end (``finish``) or abort them."""
        if in_flight == "finish":
            while self.has_pending_requests():
                self.step()
        elif in_flight == "abort":
            for request in [r for r in self._by_id.values() if not r.done]:
                self._abort(request, why)
        else:
            raise ValueError(f"in_flight must be 'finish' or 'abort', got {in_flight!r}")

    def has_pending_requests(self) -> bool:
        """Whether any request is not done yet."""
        return bool(self._running)

    def seconds_until_ready(self) -> float | None:
        """When a :meth:`step` that ran nothing while requests wait may run something: the
        admission gate (``min_batch_size`` / ``max_wait_ms``) or a queue timeout; None if
        nothing is pending."""
        return self.scheduler.seconds_until_ready()

    def stats(self) -> dict:
        """The scheduler's stats (the server's ``stats`` reply): blocks, queues, counters and
        the speculative-decoding ratios derived from them, the recent iterations."""
        stats = self.scheduler.stats()
        stats.update(speculation_rates(stats))
        return stats

    # ------------------------------------------------------------------ iterations

    def step(self) -> StepOutput:
        """Run one iteration: form the plan, run it on the model, apply its result. Returns
        the requests that got tokens or finished, and the batch's shape (None if nothing
        could run: see :meth:`seconds_until_ready`). Never blocks waiting for requests.
        Raises :class:`~conveyor.engine.ranks.RanksFailed` once a tensor-parallel rank died."""
        if self._ranks is not None:
            self._ranks.check()
        sched = self.scheduler
        plan = sched.schedule()
        changed: list[Request] = []
        self._apply(sched.take_outputs(), changed)  # queue timeouts
        if plan is None:
            return StepOutput(changed, None)
        batch = BatchInfo.from_row(sched.iterations.last())
        assert batch.step == plan.step_id
        outputs = sched.update(plan, self._execute(plan))
        self._apply(merge([outputs]), changed)
        return StepOutput(changed, batch)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int] | list[dict[str, Any]]],
        *,
        progress: bool = True,
        **sampling: Any,
    ) -> list[Result]:
        """Run ``prompts`` to the end (an offline job) and return their results in order.

        Each prompt is text, token ids, or chat messages; ``sampling`` applies to all (as in
        :meth:`add_request`). Prompts are fed as the queue takes them (a batch's worth
        waiting at a time, so ``max_waiting`` and queue timeouts concern only those), with a
        tqdm bar of finished prompts unless ``progress`` is False. Requests added otherwise
        keep running alongside. The job's requests are removed at the end (no
        continuation); if anything raises, those still running are aborted.
        """
        inputs = [_input_fields(p) for p in prompts]
        from tqdm import tqdm

        cfg = self.scheduler.config
        feed_limit = min(cfg.max_num_seqs, cfg.max_waiting) if cfg.max_waiting else cfg.max_num_seqs
        requests: list[Request] = []
        ours: set[Request] = set()
        finished = 0
        bar = tqdm(total=len(inputs), disable=not progress, desc="generate", unit="prompt")
        try:
            while finished < len(inputs):
                while len(requests) < len(inputs) and self.scheduler.num_waiting < feed_limit:
                    i = len(requests)
                    try:
                        request = self.add_request(**inputs[i], **sampling)
                    except ValueError as exc:
                        raise ValueError(f"prompts[{i}]: {exc}") from exc
                    requests.append(request)
                    ours.add(request)
                out = self.step()
                done = sum(1 for r in out.finished if r in ours)
                finished += done
                bar.update(done)
                if out.batch is None and not out.requests:
                    self._wait_until_ready()
        except BaseException:
            for request in requests:
                request.remove()
            raise
        finally:
            bar.close()
        results = [Result.of(r) for r in requests]
        for request in requests:
            request.remove()
        return results

    embed = embed  # (conveyor.engine.embeddings)
    # ------------------------------------------------------------------ inside

    def _execute(self, plan: StepPlan) -> StepResult:
        """The runner's result for ``plan`` (sent to the other tensor-parallel ranks first); a
        step that raises fails its requests, as the worker process reports it (worker/main.py),
        and the engine goes on, unless the ranks are out of step (docs/architecture.md, "conveyor.Engine")."""
        if self._ranks is not None:
            self._ranks.send(plan)
        try:
            return self.runner.execute(plan)
        except self._recoverable as exc:
            return failed_step(plan.step_id, exc)
        except Exception as exc:  # (tensor-parallel only: anything else is recoverable with one rank)
            raise self._ranks.failed(exc) from exc

    def _apply(self, outputs: list[RequestOutput], changed: list[Request]) -> None:
        """The scheduler's outputs (one per request) into each request's tokens and text,
        as the frontend's output path does: a stop string ends the request here and aborts
        it at the scheduler (its blocks are freed at once); a finish the scheduler reports
        releases the text held back."""
        for out in outputs:
            request = self._running.get(out.request_id)
            if request is None:
                continue
            if out.scheduled_time is not None:
                request.scheduled_time = out.scheduled_time
                request.num_cached_tokens = out.num_cached_tokens
            if out.first_token_time is not None:
                request.first_token_time = out.first_token_time
            if out.prompt_logprobs is not None:
                request._push_prompt_logprobs(out.prompt_logprobs)
            request._embedding = out.embedding or request._embedding
            stopped = bool(out.new_token_ids) and request._push(out.new_token_ids, out.logprobs)
            if stopped and out.finish_reason is None:
                self.scheduler.abort([out.request_id])
            if stopped or out.finish_reason is not None:
                self._finish(request, out.finish_reason, out.error, flush=not stopped)
            target = request._parent or request  # the caller's request (a sequence's n > 1 request)
            if (out.new_token_ids or request.done) and target not in changed:
                changed.append(target)

    def _finish(self, request: Request, reason: str | None, error: str | None, flush: bool) -> None:
        """End ``request`` (the scheduler has let it go) and keep its context for a continuation.
        A sequence of an n > 1 request ends alone; its request ends with its last sequence,
        or at once with an error of any (the others are aborted with that error)."""
        reason = request._end(reason or FinishReason.ABORT, error, flush)
        del self._running[request._scheduler_id]
        parent = request._parent
        if parent is None:
            del self._by_id[request.request_id]
            self._sessions.remember(
                request.request_id, request.prompt_token_ids, request._history_len, request._tokens, reason
            )
        elif reason == FinishReason.ERROR:
            self._end_request(parent, reason, error)
        elif all(seq.done for seq in parent.sequences):
            self._end_request(parent, None, None)

    def _end_request(self, request: Request, reason: str | None, error: str | None) -> None:
        """End an n > 1 request as a whole: its live sequences are aborted at the scheduler and
        end with ``reason`` (None: every sequence ended; the request's reason is then its first
        output's); the context it continued stays for the next turn (its choices are several:
        the caller continues one by sending it). With best_of > n only the n most likely
        sequences stay in :attr:`Request.outputs`, best first."""
        live = [seq for seq in request.sequences if not seq.done]
        if live:
            self.scheduler.abort([seq._scheduler_id for seq in live])
        for seq in live:
            seq._end(reason, error, flush=False)
            del self._running[seq._scheduler_id]
        leader = request.sequences[0]
        request.first_token_time = min(
            (s.first_token_time for s in request.sequences if s.first_token_time), default=None
        )
        request.sequences = best_of(
            request.sequences, request._keep_best, lambda s: cumulative_logprob(s._logprobs.values, len(s._tokens))
        )
        reason = reason or request.sequences[0].finish_reason  # (None: every sequence ended)
        request.scheduled_time, request.num_cached_tokens = leader.scheduled_time, leader.num_cached_tokens
        request._end(reason, error, flush=False)
        del self._by_id[request.request_id]
        self._sessions.restore(request.request_id, request.prompt_token_ids, request._history_len)

    def _remove(self, request: Request) -> None:
        """:meth:`Request.remove`: abort it if it runs, then forget its context (only the last
        turn under its id owns that context)."""
        if not request.done:
            self._abort(request, None)
        if self._latest.get(request.request_id) is request:
            del self._latest[request.request_id]
            self._sessions.take(request.request_id)

    def _abort(self, request: Request, error: str | None) -> None:
        """End ``request`` (not done) as aborted, with ``error`` as the reason given: an n > 1
        request with all its live sequences; no flush, as a client's abort."""
        if request.sequences:
            self._end_request(request, FinishReason.ABORT, error)
        else:
            self.scheduler.abort([request._scheduler_id])
            self._finish(request, FinishReason.ABORT, error, flush=False)

    def _wait_until_ready(self) -> None:
        """Nothing could run although requests are pending: sleep until the admission gate
        opens (``min_batch_size`` / ``max_wait_ms``) or a queue timeout is due."""
        wait = self.scheduler.seconds_until_ready()
        if wait is None:
            raise RuntimeError("requests are pending but the scheduler can run none of them and expects no change")
        time.sleep(wait)


def _input_fields(prompt: str | Sequence[int] | list[dict[str, Any]]) -> dict[str, Any]:
    """One of :meth:`Engine.generate`'s prompts as add_request's input argument."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
        return {"messages": list(prompt)}
    return {"token_ids": prompt}
