"""hf-cb's settings on whichever transformers 5.x is installed: the continuous-batching API is
detected from its signatures, never assumed (transformers renamed the page size's field from
``block_size`` to ``page_size``; bin/bench once failed on a release with the other name)."""

from __future__ import annotations

import dataclasses

import pytest

from conveyor_tools.bench import hf

SETTINGS = {"page_size": 256, "num_blocks": 40, "max_batch_tokens": 512, "max_requests_per_batch": 8}


@dataclasses.dataclass
class NewSpelling:  # as transformers 5.24: page_size, with block_size still taken (deprecated)
    page_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_requests_per_batch: int | None = None
    block_size: int | None = None


@dataclasses.dataclass
class OldSpelling:  # as the releases before the rename: block_size only
    block_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_requests_per_batch: int | None = None


class PlainInit:  # not a dataclass: names come from __init__'s signature
    def __init__(self, block_size: int = 256, *, num_blocks=None, max_batch_tokens=None, max_requests_per_batch=None):
        self.block_size = block_size


class SwallowsEverything:  # a **kwargs would take any name and might ignore it
    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs


def test_mapping_takes_the_newest_name_a_config_has():
    assert hf.cb_config_kwargs(NewSpelling, SETTINGS) == SETTINGS  # page_size, not the deprecated block_size
    old = hf.cb_config_kwargs(OldSpelling, SETTINGS)
    assert old == {"block_size": 256, "num_blocks": 40, "max_batch_tokens": 512, "max_requests_per_batch": 8}
    assert OldSpelling(**old).block_size == 256
    assert hf.cb_config_kwargs(PlainInit, SETTINGS)["block_size"] == 256


def test_a_setting_without_a_name_fails_the_run_with_the_reason():
    @dataclasses.dataclass
    class NoRequestCap:
        page_size: int = 256
        num_blocks: int | None = None
        max_batch_tokens: int | None = None

    with pytest.raises(hf.HFRunFailed, match=r"NoRequestCap has no field for max_requests_per_batch") as err:
        hf.cb_config_kwargs(NoRequestCap, SETTINGS)
    assert "transformers 5." in str(err.value) and "it takes max_batch_tokens, num_blocks, page_size" in str(err.value)
    with pytest.raises(hf.HFRunFailed, match=r"page_size \(tried page_size, block_size\)"):
        hf.cb_config_kwargs(SwallowsEverything, SETTINGS)


def test_call_kwargs_requires_what_must_be_passed_and_drops_what_is_optional():
    def manager(generation_config=None, continuous_batching_config=None, block=True):
        return None

    got = hf.call_kwargs(manager, {"continuous_batching_config": 1}, {"block": False, "warmup": True})
    assert got == {"continuous_batching_config": 1, "block": False}
    with pytest.raises(hf.HFRunFailed, match="takes no workload"):
        hf.call_kwargs(manager, {"workload": 1}, {})


@pytest.fixture(scope="module")
def tiny_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf.quiet_transformers()
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
        )
    ).eval()


def test_installed_transformers_builds_the_config_for_a_tiny_model(tiny_model):
    """The installed release's own ContinuousBatchingConfig takes our settings, and its engine
    accepts the config for a tiny model (built, not run)."""
    import transformers
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = tiny_model
    num_blocks = hf.kv_blocks_for(model, 0.001, 4)
    assert num_blocks == 2**20 // (2 * 2 * 2 * 8 * 4 * hf.HF_CB_PAGE_SIZE)  # layers, K and V, kv heads, head dim, fp32
    cb = hf.continuous_batching_config(num_blocks, 64, 3)
    assert isinstance(cb, ContinuousBatchingConfig)
    fields = hf.accepted_names(ContinuousBatchingConfig)
    page_field = "page_size" if "page_size" in fields else "block_size"
    assert (getattr(cb, page_field), cb.num_blocks, cb.max_batch_tokens, cb.max_requests_per_batch) == (
        hf.HF_CB_PAGE_SIZE,
        num_blocks,
        64,
        3,
    ), transformers.__version__
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=4)
    init = model.init_continuous_batching
    manager = init(**hf.call_kwargs(init, {"generation_config": gen, "continuous_batching_config": cb}, {}))
    assert not manager.is_running()


def test_hf_cb_runs_on_the_installed_transformers(tiny_model):
    """The whole hf-cb run on CPU: every request gets exactly its output length (run_hf_cb
    checks), and at most ``batch_size`` requests run at once."""
    from conveyor_tools.bench.workloads import BenchRequest, Workload

    class Progress:
        done = 0

        def update(self, n: int) -> None:
            self.done += n

    reqs = [BenchRequest([5, 6, 7, 8, 9][: 2 + i % 4], 3 + i) for i in range(4)]
    progress = Progress()
    run = hf.run_hf_cb(tiny_model, Workload("tiny", 0, reqs), 2, 64, 0.001, progress)
    assert progress.done == 4 and run.extra["batch_size"] == 2
    assert max(run.timeline.running) == 2 and run.timeline.running[-1] == 0


@pytest.mark.parametrize("spelling", ["installed", "without a request cap"])
def test_bin_bench_offline_reports_hf_cb_or_why_not(tiny_checkpoint, monkeypatch, capsys, spelling):
    """bin/bench offline with hf-cb on the tiny checkpoint: it runs on the installed
    transformers; on a release whose config lacks one of our settings the table says
    ``n/a`` and names the missing setting, with no number."""
    import transformers

    from conveyor_tools.bench.workloads import BenchRequest, Workload
    from conveyor_tools.cli import bench

    if spelling != "installed":

        @dataclasses.dataclass
        class ContinuousBatchingConfig:
            block_size: int = 256
            num_blocks: int | None = None
            max_batch_tokens: int | None = None

        monkeypatch.setattr(transformers, "ContinuousBatchingConfig", ContinuousBatchingConfig)
    argv = ["offline", "--model", str(tiny_checkpoint), "--systems", "hf-cb", "--no-progress", "--batch-size", "2",
            "--kv-cache-memory", "0.001", "--max-batched-tokens", "64", "--threads", "1"]  # fmt: skip
    args = bench.build_parser().parse_args(argv)
    reqs = [BenchRequest([5, 6, 7, 8][: 2 + i % 3], 2 + i) for i in range(3)]
    workload = Workload("tiny", 0, reqs)
    ctx = {
        "workload": workload,
        "systems": ["hf-cb"],
        "device": "cpu",
        "model_dir": str(tiny_checkpoint),
        "vocab_size": 128,
    }
    result = bench.offline(args, ctx)["systems"]["hf-cb"]
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("hf-cb"))
    if spelling == "installed":
        assert "unavailable" not in result, result
        assert result["runs"][0]["output_tokens"] == sum(r.output_len for r in reqs) and "n/a" not in row
    else:
        reason = result["unavailable"]
        assert reason.startswith("HFRunFailed: transformers ") and "no field for max_requests_per_batch" in reason
        assert row.split()[:2] == ["hf-cb", "n/a:"] and "max_requests_per_batch" in row
