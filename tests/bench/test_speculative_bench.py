"""bin/bench speculative: the copy checkpoint copies (greedy reproduces the prompt's passage,
through the engine's normal load path and in HF transformers), its workloads are what they
claim, and the sweep's table has its columns and ratios against ``off``."""

from __future__ import annotations

import numpy as np
import pytest

from conveyor_tools.bench import speculative
from conveyor_tools.bench.copy_model import CYCLE_LEN, copy_checkpoint_dir, copy_workload, successor

VOCAB = 4096  # the demo tokenizer's, which the copy checkpoint keeps


@pytest.fixture(scope="module")
def copy_dir(tmp_path_factory):
    import os

    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("CONVEYOR_CACHE")
    os.environ["CONVEYOR_CACHE"] = str(cache)
    try:
        yield copy_checkpoint_dir()
    finally:
        if old is None:
            del os.environ["CONVEYOR_CACHE"]
        else:
            os.environ["CONVEYOR_CACHE"] = old


def test_successor_is_a_permutation_of_cycles():
    succ = successor(VOCAB)
    assert sorted(succ.tolist()) == list(range(VOCAB))
    token, seen = 5, []
    while token not in seen:
        seen.append(token)
        token = int(succ[token])
    assert len(seen) == CYCLE_LEN and token == 5


def test_workloads_hold_the_passage_or_its_shuffle():
    succ = successor(VOCAB)
    copy = copy_workload("copy", 3, VOCAB, 40, seed=1)
    mis = copy_workload("mispredict", 3, VOCAB, 40, seed=1)
    for c, m in zip(copy.requests, mis.requests):
        assert len(c.prompt_ids) == CYCLE_LEN and c.output_len == 40
        assert all(succ[a] == b for a, b in zip(c.prompt_ids, c.prompt_ids[1:]))  # a walk of the successor
        cycle = [m.prompt_ids[0]]
        while len(cycle) < CYCLE_LEN:
            cycle.append(int(succ[cycle[-1]]))
        assert sorted(m.prompt_ids) == sorted(cycle) and m.prompt_ids != cycle  # a whole cycle, shuffled
        hits = sum(succ[a] == b for a, b in zip(m.prompt_ids, m.prompt_ids[1:]))
        assert hits < 5  # what followed a token there is almost never its successor
    with pytest.raises(ValueError):
        copy_workload("mispredict", 1, VOCAB, CYCLE_LEN, seed=1)  # the output would repeat itself


def test_the_copy_checkpoint_repeats_the_passage_through_the_engine_and_hf(copy_dir):
    from conveyor import Engine

    [request] = copy_workload("copy", 1, VOCAB, 24, seed=2).requests
    engine = Engine(str(copy_dir), threads=1, device="cpu", num_kv_blocks=64, max_model_len=512,
                    speculative_method="ngram", num_speculative_tokens=4)  # fmt: skip
    [result] = engine.generate([request.prompt_ids], max_tokens=24, temperature=0.0, ignore_eos=True, progress=False)
    # The prompt is one whole cycle: the output starts it over.
    assert result.token_ids == request.prompt_ids[:24]
    stats = engine.stats()
    assert stats["spec_acceptance_rate"] == 1.0 and stats["num_steps"] <= 24 // 5 + 2

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(copy_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([request.prompt_ids + result.token_ids[:4]])).logits[0]
    assert logits[-5:].argmax(-1).tolist() == result.token_ids[:5]


def _cell(
    batch, workload, method, tok_s, forwards, cpu, wall=2.0, tokens=96, accepted=0, proposals=0, proposed=0, steps=0
):
    counters = {"num_steps": forwards, "spec_num_proposals": proposals, "spec_proposed_tokens": proposed,
                "spec_accepted_tokens": accepted, "spec_num_steps": steps}  # fmt: skip
    run = {"output_tok_s": tok_s, "wall_s": wall, "output_tokens": tokens}
    cell = speculative.cell(run, counters, {"worker": cpu * 0.75, "scheduler": cpu * 0.25})
    return speculative.median_cell((batch, workload, method), [cell])


def test_table_has_the_columns_and_the_ratios_against_off():
    cells = speculative.with_ratios([
        _cell(1, "copy", "ngram", 90.0, 24, cpu=1.2, wall=1.0, accepted=72, proposals=24, proposed=96, steps=24),
        _cell(1, "copy", "off", 48.0, 96, cpu=2.0),
    ])  # fmt: skip
    on = next(c for c in cells if c["method"] == "ngram")
    assert on["speedup"] == pytest.approx(90 / 48) and on["forward_ratio"] == pytest.approx(4.0)
    assert on["cpu_ms_per_step"] == pytest.approx(50.0) and on["step_ratio"] == pytest.approx(50.0 / (2000 / 96))
    assert on["cpu_speedup"] == pytest.approx((96 / 1.2) / (96 / 2.0))
    assert on["spec_acceptance_rate"] == 0.75 and on["spec_mean_acceptance_length"] == 4.0
    lines = speculative.table(cells).splitlines()
    assert [h.strip() for h in lines[0].strip("|").split("|")] == list(speculative.COLUMNS)
    off_row, on_row = lines[2], lines[3]  # off first within a batch and workload
    assert "| off |" in off_row and off_row.rstrip(" |").endswith("- | - | -")
    assert "| ngram | 90.0 | 1.88 | 24 | 4.00 | 4.00 | 50.00 | 2.40 | 1.67 | 0.75 | 4.00 | 1.0 |" in on_row


def test_nolimit_runs_only_above_the_batch_rule():
    settings = speculative.SpecSettings()
    assert speculative.methods_at(settings, 8) == ["off", "ngram"]
    assert speculative.methods_at(settings, 64) == ["off", "ngram", "ngram-nolimit"]
    assert np.array_equal(speculative.method_flags("off", 4), [])
    assert speculative.method_flags("ngram", 3)[-2:] == ["--num-speculative-tokens", "3"]
    assert speculative.method_flags("off-nooverlap", 3) == ["--no-overlap"]
    # The draft methods name real checkpoints: the served copy model itself, and the demo model
    # (its vocabulary, random weights).
    from conveyor.checkpoints.demo.checkpoint import demo_checkpoint_dir
    from conveyor_tools.bench.copy_model import copy_checkpoint_dir

    for method, draft in (("draft-self", copy_checkpoint_dir()), ("draft-random", demo_checkpoint_dir())):
        flags = speculative.method_flags(method, 2)
        assert flags == [
            "--speculative-method",
            "draft",
            "--speculative-model",
            str(draft),
            "--num-speculative-tokens",
            "2",
        ]
        assert (draft / "config.json").is_file()
