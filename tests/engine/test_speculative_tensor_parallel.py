"""Speculative decoding at tensor parallelism 2 (gloo, CPU): only rank 0 holds the LM head and
scores the proposals; it broadcasts the targets and every rank accepts the same tokens. Each
forked rank runs an engine (its scheduler forms the same plans from the same results) whose
runner is that rank; both ranks' greedy outputs equal one process's with speculation and
HF transformers', through verify steps on the static path and on the ragged one (beside
chunked prefills)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.multiprocessing as mp

from conveyor.worker.parallel import close_tensor_parallel, default_backend, init_tensor_parallel
from tests.engine.conftest import TINY
from tests.engine.test_speculative import SPEC, _serve, repetitive
from tests.engine.test_verify_step import record_static_steps

PROMPTS = {f"r{i}": repetitive(i) for i in range(4)}
CONFIG = dict(TINY, max_batch_size=4, max_batch_tokens=16, threads=1, **SPEC)
MAX_TOKENS = 16


def rank_engine(directory: str, config: dict, tensor_parallel=None):
    """An engine of ``config`` whose runner is ``tensor_parallel``'s rank (one process when None)."""
    import conveyor.engine.engine as engine_module
    from conveyor import Engine

    build = engine_module.build_runner
    # (over the engine's own tensor_parallel: one rank's, as it runs in one process)
    engine_module.build_runner = lambda runner_config, **kw: build(
        runner_config, **{**kw, "tensor_parallel": tensor_parallel}
    )
    try:
        engine = Engine(directory, **config)
    finally:
        engine_module.build_runner = build
    assert engine.runner.tensor_parallel.size == (1 if tensor_parallel is None else tensor_parallel.size)
    return engine


def run_ranks(target, size: int, tmp_path: Path, *args) -> list:
    """Fork ``size`` gloo ranks, each calling ``target(*args, tp)`` with its rank's record (one
    torch thread each), and return what each returned (through JSON), in rank order."""
    spawn_args = (size, str(tmp_path / "init"), str(tmp_path), target, args)
    mp.start_processes(_rank, args=spawn_args, nprocs=size, join=True, start_method="fork")
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(size)]


def _rank(rank: int, size: int, init_file: str, out_dir: str, target, args: tuple) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, size, f"file://{init_file}", default_backend("cpu"), timeout_s=60)
    result = target(*args, tp)
    close_tensor_parallel(tp)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def serve(directory: str, tensor_parallel=None) -> dict:
    """The prompts' greedy outputs from an engine whose runner is ``tensor_parallel``'s rank,
    with the verify steps that ran the static path and the acceptance count."""
    engine = rank_engine(directory, CONFIG, tensor_parallel)
    steps = record_static_steps(engine.runner)
    ragged, run_ragged = [], engine.runner.ragged.run

    def spy(rows, drafts=None):
        ragged.append(any(item.proposal for item in rows.work))
        return run_ragged(rows, drafts)

    engine.runner.ragged.run = spy
    outputs = _serve(engine, PROMPTS, MAX_TOKENS)
    return {
        "outputs": outputs,
        "static_verify_steps": sum(q > 1 for _, _, q, _ in steps),
        "ragged_verify_steps": sum(ragged),
        "accepted": engine.stats()["spec_accepted_tokens"],
    }


def test_two_ranks_speculate_as_one(tiny_checkpoint, hf_greedy, tmp_path):
    ranks = run_ranks(serve, 2, tmp_path, str(tiny_checkpoint))
    single = serve(str(tiny_checkpoint))
    assert single["static_verify_steps"] > 0 and single["ragged_verify_steps"] > 0 and single["accepted"] > 0
    for rank in ranks:
        assert rank == single
    for rid, prompt in PROMPTS.items():
        assert single["outputs"][rid] == hf_greedy(prompt, MAX_TOKENS), rid
