"""Speculative verify steps through the static decode buffers (worker/decode_step.py): a step
whose every row is a decode, some with proposals, runs as ``1 + k`` query tokens per row, and
its greedy output equals the ragged path's and HF transformers' token for token, with
proposals of mixed lengths (rows without one beside them), rows padded to buckets and
proposals padded to the fixed width, recompute preemptions, on the torch backend and on the
Triton kernels (interpreted on CPU). The CUDA-graph replay of the same steps is checked on a
GPU (test_verify_step_graphs.py)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.engine.test_speculative import SPEC, _serve, repetitive

K = SPEC["num_speculative_tokens"]


def record_static_steps(runner) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """Record (rows, bucket, q, proposal lengths) of every step that takes the static path."""
    calls: list[tuple[int, int, int, tuple[int, ...]]] = []
    run_decode = runner.decode.run

    def spy(rows, q):
        work = rows.work
        calls.append(
            (len(work), runner.decode.buffers.bucket_for(len(work)), q, tuple(len(item.proposal) for item in work))
        )
        return run_decode(rows, q)

    runner.decode.run = spy
    return calls


def pad_decode_runners(monkeypatch) -> None:
    """Every runner built from now on (the engine's too) pads decode batches (pad_decode)."""
    import conveyor.worker.model_runner as runner_module

    real = runner_module.ModelRunner
    monkeypatch.setattr(
        runner_module, "ModelRunner", lambda config, **kw: real(dataclasses.replace(config, pad_decode=True), **kw)
    )


@pytest.mark.parametrize(
    "attention,pad",
    [("torch", False), ("torch", True), ("triton", True)],
    ids=["torch-eager", "torch-padded", "triton-padded"],
)
def test_static_verify_steps_equal_ragged_and_hf(attention, pad, tiny_engine, hf_greedy, monkeypatch):
    if pad:  # pad rows to the graph buckets and proposals to the fixed width, as with CUDA graphs
        pad_decode_runners(monkeypatch)
    # (the Triton interpreter is slow: fewer requests, and no ragged run beside it)
    count, max_tokens = (6, 20) if attention == "torch" else (3, 12)
    prompts = {f"r{i}": repetitive(i) for i in range(count)}
    config = dict(max_batch_size=4, max_batch_tokens=16, num_kv_blocks=24, preemption="recompute", attention=attention)
    static_engine = tiny_engine(**config, **SPEC)
    static_steps = record_static_steps(static_engine.runner)
    static = _serve(static_engine, prompts, max_tokens)
    stats = static_engine.stats()

    verify = [step for step in static_steps if step[2] > 1]
    assert verify, static_steps
    for rows, bucket, q, lengths in verify:
        assert q - 1 == (K if pad else max(lengths)), (q, lengths)
    assert any(len(set(lengths)) > 1 for *_, lengths in verify), "no verify step mixed proposal lengths"
    if attention == "torch":
        assert stats["num_preemptions"] > 0, "the run was to preempt"
    if pad:
        assert any(bucket > rows for rows, bucket, _, _ in verify), "no verify step padded its rows"

    assert stats["spec_accepted_tokens"] > 0 and stats["held_blocks"] == 0
    for rid, prompt in prompts.items():
        assert static[rid] == hf_greedy(prompt, max_tokens), rid
    if attention == "torch":  # the same run with verify steps on the ragged path (the buffers refuse proposals)
        ragged_engine = tiny_engine(**config, **SPEC)
        ragged_engine.runner.decode.verify_widths = [0]
        ragged_steps = record_static_steps(ragged_engine.runner)
        ragged = _serve(ragged_engine, prompts, max_tokens)
        assert all(q == 1 for _, _, q, _ in ragged_steps)
        assert ragged_engine.stats()["spec_accepted_tokens"] > 0
        assert ragged == static
