"""The static-buffer decode step: padded buckets, one staging copy, and the same greedy tokens
as the flattened ragged path (and HF) for every supported family, across joins, leaves and
preemptions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.runtime.config import RunnerConfig
from conveyor.worker.model_runner import ModelRunner
from conveyor.worker.step_buffers import StepBuffers, context_buckets, decode_buckets, smallest_fitting
from tests.worker.test_generation import hf_greedy, prompts

BLOCK_SIZE = 4


def test_buckets():
    assert decode_buckets(256)[:9] == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert decode_buckets(256)[-2:] == [240, 256]
    assert decode_buckets(5) == [1, 2, 4, 5]
    assert decode_buckets(1) == [1]
    assert smallest_fitting(decode_buckets(256), 3) == 4
    assert smallest_fitting(decode_buckets(256), 33) == 48
    assert context_buckets(128) == [128]
    assert context_buckets(40960) == [512, 2048, 8192, 32768, 40960]
    with pytest.raises(ValueError):
        smallest_fitting([1, 2, 4], 5)


def test_staged_fields_reach_their_device_views():
    buffers = StepBuffers([1, 4, 8], 6, torch.device("cpu"), max_query_len=3)
    rng = np.random.default_rng(0)
    for rows, width, q in ((4, 3, 1), (8, 6, 3), (1, 1, 2), (4, 3, 1), (8, 6, 1)):
        host = buffers.stage(rows, width, q)
        assert host["slot_mapping"].tolist() == [-1] * rows * q and host["seq_lens"].tolist() == [q] * rows
        assert host["input_ids"].shape == (rows * q,) and host["block_tables"].shape == (rows, width)
        expected = {}
        for name, view in host.items():
            view[...] = rng.integers(0, 100, view.shape).astype(view.dtype)
            expected[name] = view.copy()
        inputs = buffers.upload(rows, width, q)
        assert inputs.rows == rows and inputs.query_len == q
        assert inputs.query_start_loc.tolist() == list(range(0, rows * q + 1, q))
        for name, values in expected.items():
            assert np.array_equal(getattr(inputs, name).numpy(), values), name
        assert buffers.inputs(rows, width, q).input_ids.data_ptr() == inputs.input_ids.data_ptr()  # fixed views


def decode_rows(runner: ModelRunner) -> list[int]:
    """Record the row count of every step that takes the static decode path."""
    calls: list[int] = []
    run_decode = runner.decode.run

    def spy(rows, q):
        calls.append(len(rows.work))
        return run_decode(rows, q)

    runner.decode.run = spy
    return calls


@pytest.mark.parametrize("name", ["llama", "qwen2_tied", "qwen3"])
def test_static_decode_matches_ragged_path_and_transformers(name, checkpoint_factory, scripted, script):
    directory, hf_model = checkpoint_factory(name)

    def scripts(vocab: int, mixer: bool) -> list:
        p = prompts(vocab, [5, 7, 3, 9, 4, 100], seed=3)
        out = [
            script("a", p[0], max_new=16),
            script("b", p[1], max_new=14),
            script("c", p[2], max_new=8, join=1),
            script("d", p[3], max_new=6, join=2, chunk=4),
            script("e", p[4], max_new=9, join=3, preempt_after=3),
        ]
        if mixer:  # a long prompt fed 3 tokens a step: every step of the others is a mixed one
            out.append(script("mixer", p[5], max_new=1, chunk=3))
        return out

    # Padded to the graph buckets as on a GPU (eagerly, CPU runners pad nothing by default).
    static_runner = ModelRunner(
        RunnerConfig(
            directory,
            block_size=BLOCK_SIZE,
            num_blocks=96,
            max_num_seqs=8,
            pad_decode=True,
        ),
    )
    static_rows = decode_rows(static_runner)
    static = scripted(static_runner, scripts(static_runner.model_config.vocab_size, False)).run()
    ragged_runner = ModelRunner(RunnerConfig(directory, block_size=BLOCK_SIZE, num_blocks=96, max_num_seqs=8))
    ragged_rows = decode_rows(ragged_runner)
    mixed_scripts = scripts(ragged_runner.model_config.vocab_size, True)
    mixed = scripted(ragged_runner, mixed_scripts).run()

    assert {3, 5} <= set(static_rows), static_rows  # 3 rows pad to a bucket of 4, 5 to one of 8
    assert max(ragged_rows, default=0) <= 1, "with the mixer running, the others decode in mixed steps"
    for s in mixed_scripts[:5]:
        assert static[s.request_id] == mixed[s.request_id], (name, s.request_id)
        assert static[s.request_id] == hf_greedy(hf_model, s.prompt, s.max_new), (name, s.request_id)


def test_a_step_beyond_max_num_seqs_is_refused(llama_dir):
    from conveyor.ipc.messages import NewRequestData, SamplingParams
    from tests.plans import plan

    runner = ModelRunner(RunnerConfig(llama_dir, block_size=BLOCK_SIZE, num_blocks=16, max_num_seqs=2))
    new = [NewRequestData(f"r{i}", i, [5, 6], SamplingParams(temperature=0.0), [i], 0, 2) for i in range(3)]
    with pytest.raises(ValueError, match="at most 2"):
        runner.execute(plan(0, new))
    assert runner.request_ids == []


def test_graphs_share_bounds_with_equal_launch_plans():
    """A step uses the graph of the largest context bound whose decode plan equals its own
    bound's (the grid covers any shorter context); bounds with different plans keep their own.
    Built without capturing, so it runs on CPU."""
    from conveyor.worker.cuda_graphs import DecodeGraphs

    buffers = StepBuffers(decode_buckets(64), 8, torch.device("cpu"), max_query_len=4)
    bounds = [32, 64, 96, 128]
    # big batches: one plan for every bound; small ones: bounds up to 64 differ from the rest;
    # verify steps (q > 1): one plan for every bound
    key = lambda rows, q, bound: "one" if rows >= 16 or q > 1 else ("short" if bound <= 64 else "long")  # noqa: E731
    graphs = DecodeGraphs(lambda inputs, bound: None, buffers, [1, 4], bounds, 16, key)
    assert [graphs.bound_for(32, 1, seq) for seq in (1, 40, 100, 128)] == [128, 128, 128, 128]
    assert [graphs.bound_for(4, 1, seq) for seq in (1, 33, 65, 128)] == [64, 64, 128, 128]
    assert [graphs.bound_for(4, 4, seq) for seq in (4, 33, 65, 128)] == [128, 128, 128, 128]
    assert graphs.width(128) == 8 and graphs.width(64) == 4


def test_which_steps_run_through_the_static_buffers(llama_dir):
    """Decodes and verifies of proposals up to the width run static, padded to the fixed width
    with graphs' padding (eagerly, to the longest proposal); prefill chunks, longer proposals
    and padded positions past the buffers' last context bound run ragged (None)."""
    from conveyor.worker.request_state import Work

    def row(computed: int, proposal: tuple[int, ...] = (), scheduled: int | None = None) -> Work:
        return Work(0, computed, 1 + len(proposal) if scheduled is None else scheduled, [], proposal)

    padded = ModelRunner(
        RunnerConfig(
            llama_dir,
            block_size=BLOCK_SIZE,
            num_blocks=16,
            max_num_seqs=4,
            num_speculative_tokens=3,
            pad_decode=True,
        ),
    )
    eager = ModelRunner(
        RunnerConfig(
            llama_dir,
            block_size=BLOCK_SIZE,
            num_blocks=16,
            max_num_seqs=4,
            num_speculative_tokens=3,
        ),
    )
    assert padded.decode.context_bounds[-1] == 64  # the pool's 16 blocks of 4
    for runner, verify_q in ((padded, 4), (eager, 3)):
        assert runner.decode.static_query_len([row(5), row(7)]) == 1
        assert runner.decode.static_query_len([row(5, (1, 2)), row(7)]) == verify_q
        assert runner.decode.static_query_len([row(5, (1, 2, 3, 4))]) is None
        assert runner.decode.static_query_len([row(5), row(7, scheduled=3)]) is None
        assert runner.decode.static_query_len([row(64 - verify_q, (1, 2))]) == verify_q
        assert runner.decode.static_query_len([row(65 - verify_q, (1, 2))]) is None
    assert (
        ModelRunner(
            RunnerConfig(
                llama_dir,
                block_size=BLOCK_SIZE,
                num_blocks=16,
            ),
        ).decode.static_query_len([row(5, (1,))])
        is None
    )
