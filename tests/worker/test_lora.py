"""LoRA adapters in the worker: greedy tokens per adapter equal HF transformers with PEFT,
with several adapters and the base model in one batch (chunked prefill, preemption), the
batched gather against a per-token float32 reference, slot eviction, and load errors."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conveyor.runtime.config import RunnerConfig
from conveyor.worker.lora import LoraLoadError
from conveyor.worker.lora_delta import LoraContext, LoraStack, build_batch
from conveyor.worker.model_runner import ModelRunner
from tests.lora_adapters import make_adapter
from tests.worker.parity import hf_greedy_with_logits

ADAPTERS = [  # (rank, alpha, targets, rslora): ranks under the bound, subsets of targets, rsLoRA
    (8, 16.0, None, False),
    (16, 8.0, ["q_proj", "v_proj", "down_proj"], False),
    (4, 8.0, ["k_proj", "o_proj", "gate_proj", "up_proj"], True),
    (16, 32.0, None, False),
]


@pytest.fixture(scope="module")
def adapters_of(tmp_path_factory, checkpoint_factory):
    """``adapters_of(family) -> (checkpoint dir, hf base, {name: (dir, peft model)})``."""
    built = {}

    def make(family):
        if family not in built:
            directory, hf = checkpoint_factory(family)
            made = {}
            for i, (rank, alpha, targets, rslora) in enumerate(ADAPTERS):
                target = tmp_path_factory.mktemp(f"{family}-lora{i}")
                made[f"a{i}"] = (
                    target,
                    make_adapter(hf, target, seed=i, rank=rank, alpha=alpha, targets=targets, rslora=rslora),
                )
            built[family] = (directory, hf, made)
        return built[family]

    return make


@pytest.mark.parametrize("family", ["llama", "qwen2_tied", "qwen3", "gemma3"])
def test_adapters_and_base_in_one_batch_match_peft(family, adapters_of, scripted, script):
    directory, hf, adapters = adapters_of(family)
    runner = ModelRunner(
        RunnerConfig(
            directory,
            block_size=4,
            num_blocks=96,
            enable_lora=True,
            max_loras=4,
            max_lora_rank=16,
            lora_modules=tuple((name, str(path)) for name, (path, _) in adapters.items()),
        ),
    )
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=generator).tolist() for n in (9, 17, 5, 23, 12)]
    names = [None, "a0", "a1", "a2", "a3"]
    scripts = [
        script(
            f"r{i}-{name}",
            prompts[i],
            max_new=7,
            chunk=6 if i % 2 else None,
            join=i % 3,
            lora=name,
            preempt_after=3 if i in (1, 4) else None,
        )
        for i, name in enumerate(names)
    ]
    # the same prompt under the base and an adapter: its rows must not mix
    scripts.append(script("same-prompt-a0", prompts[0], max_new=7, lora="a0"))
    outputs = scripted(runner, scripts).run()
    base_tokens, _ = hf_greedy_with_logits(hf, prompts[0], 7)
    for s in scripts:
        reference = hf if s.lora is None else adapters[s.lora][1]
        want, _ = hf_greedy_with_logits(reference, s.prompt, 7)
        assert outputs[s.request_id] == want, s.request_id
    # the adapters change the tokens (else this test could not see one ignored)
    assert outputs["same-prompt-a0"] != base_tokens


def test_triton_backend_in_the_model_matches_peft(adapters_of, scripted, script, monkeypatch):
    """The kernels (interpreted on CPU tensors) wired into every stack: each fused projection's
    piece columns come from the real layout, so a misplaced q/k/v or gate/up slice shows here."""
    import functools

    from conveyor.worker import lora

    monkeypatch.setattr(lora, "LoraContext", functools.partial(LoraContext, triton=True))
    directory, hf, adapters = adapters_of("qwen3")
    names = ["a1", "a2"]  # subsets of targets: zero blocks in the fused stacks
    runner = ModelRunner(
        RunnerConfig(
            directory,
            block_size=4,
            num_blocks=32,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=16,
            lora_modules=tuple((name, str(adapters[name][0])) for name in names),
        ),
    )
    assert runner.lora.context.kernels is not None
    prompt = list(range(3, 12))
    scripts = [script(f"{lora}", prompt, max_new=4, lora=lora, chunk=5) for lora in (None, *names)]
    outputs = scripted(runner, scripts).run()
    for s in scripts:
        want, _ = hf_greedy_with_logits(hf if s.lora is None else adapters[s.lora][1], prompt, 4)
        assert outputs[s.request_id] == want, s.request_id


def test_lora_on_cuda_without_triton_fails_clearly(monkeypatch):
    """No silent torch path on CUDA: the stacks' context refuses to exist without the kernels."""
    import sys

    import conveyor.kernels

    monkeypatch.delattr(conveyor.kernels, "lora", raising=False)
    monkeypatch.setitem(sys.modules, "conveyor.kernels.lora", None)
    with pytest.raises(RuntimeError, match="LoRA adapters on CUDA run Triton kernels"):
        LoraContext(torch.device("cuda"), torch.bfloat16)
    assert LoraContext(torch.device("cpu"), torch.float32).kernels is None


def test_slots_evicted_lru_and_host_copies_spilled(adapters_of, scripted, script):
    directory, hf, adapters = adapters_of("llama")
    runner = ModelRunner(
        RunnerConfig(
            directory,
            block_size=4,
            num_blocks=64,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=16,
            max_cpu_loras=2,
            lora_modules=tuple((name, str(path)) for name, (path, _) in adapters.items()),
        ),
    )
    prompt = list(range(3, 14))
    for pair in (("a0", "a1"), ("a2", "a3"), ("a1", "a2"), ("a3", "a0")):  # every round evicts
        scripts = [script(f"{name}-{pair}", prompt, max_new=5, lora=name) for name in pair]
        outputs = scripted(runner, scripts).run()
        for s in scripts:
            want, _ = hf_greedy_with_logits(adapters[s.lora][1], prompt, 5)
            assert outputs[s.request_id] == want, s.request_id
    assert len(runner.lora._host) == 2 and len(runner.lora._resident) == 2


def test_an_adapter_is_read_once_and_served_after_its_directory_is_gone(adapters_of, scripted, script, tmp_path):
    """Loaded, then its directory deleted: evicted from the one host copy and the one slot,
    each adapter comes back from the worker's own spill file with the same tokens; an unload
    removes that file."""
    directory, hf, adapters = adapters_of("llama")
    runner = ModelRunner(
        RunnerConfig(
            directory, block_size=4, num_blocks=64, enable_lora=True, max_loras=1, max_lora_rank=16, max_cpu_loras=1
        ),
    )
    names = ("a1", "a2")
    for name in names:
        copy_dir = shutil.copytree(adapters[name][0], tmp_path / name)
        runner.adapters.load_lora(name, str(copy_dir))
        shutil.rmtree(copy_dir)
    prompt = list(range(3, 14))
    for name in (*names, *names):  # every turn evicts the other's host copy and slot
        outputs = scripted(runner, [script(name, prompt, max_new=5, lora=name)]).run()
        assert outputs[name] == hf_greedy_with_logits(adapters[name][1], prompt, 5)[0], name
    spill_dir = Path(runner.lora._spilled._dir.name)
    assert len(list(spill_dir.iterdir())) == 2
    runner.adapters.unload_lora("a1")
    assert len(list(spill_dir.iterdir())) == 1


@pytest.mark.parametrize("triton", [False, True])
def test_batched_delta_equals_per_token_float32_reference(triton):
    """Both backends (Triton interpreted on CPU tensors), a fused projection of three pieces."""
    from conveyor.kernels.lora import lora_delta_ref

    torch.manual_seed(0)
    slots, rank, d_in, tokens = 3, 2, 10, 13
    columns = [(0, 4), (4, 6), (6, 8)]
    stack = LoraStack(slots, rank, columns, d_in, 8, LoraContext(torch.device("cpu"), torch.float32, triton=triton))
    stack.a.normal_()
    for p, (first, last) in enumerate(columns):  # block-diagonal, as LoraManager fills it
        stack.b[:, first:last, p * rank : (p + 1) * rank].normal_()
    token_slots = np.array([2, -1, 0, 2, 2, -1, 1, 0, 2, -1, -1, 2, 0])
    x = torch.randn(tokens, d_in)
    base = torch.randn(tokens, 8)
    stack.context.begin(token_slots)
    got = stack.add_delta(x, base.clone())
    want = lora_delta_ref(x, base, stack.a, stack.b, torch.from_numpy(token_slots), columns)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    stack.context.begin(np.full(4, -1))
    assert stack.context.batch is None
    assert build_batch(np.full(4, -1), torch.float32, torch.device("cpu")) is None


def _copy_adapter(src, dst, edit=None):
    shutil.copytree(src, dst)
    if edit:
        config = json.loads((dst / "adapter_config.json").read_text())
        edit(config)
        (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


def test_load_errors_are_clear_and_leave_the_runner_serving(
    adapters_of, checkpoint_factory, tmp_path, scripted, script
):
    directory, hf, adapters = adapters_of("llama")
    good = adapters["a0"][0]
    runner = ModelRunner(
        RunnerConfig(
            directory,
            block_size=4,
            num_blocks=32,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
        ),
    )
    cases = {
        "rank": (adapters["a1"][0], "rank 16 is over --max-lora-rank 8"),
        "target": (
            _copy_adapter(good, tmp_path / "t", lambda c: c.update(target_modules=["q_proj", "lm_head"])),
            "lm_head the model lacks",
        ),
        "base": (adapters_of("qwen3")[2]["a0"][0], "another base model"),
        "missing": (tmp_path / "nowhere", "missing file"),
    }
    for name, (path, message) in cases.items():
        with pytest.raises(LoraLoadError, match=message):
            runner.lora.register(name, path)
    assert runner.lora.names == []
    runner.lora.register("a0", good)
    outputs = scripted(runner, [script("x", list(range(3, 12)), max_new=4, lora="a0")]).run()
    want, _ = hf_greedy_with_logits(adapters["a0"][1], list(range(3, 12)), 4)
    assert outputs["x"] == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_adapters_match_peft(dtype, adapters_of, scripted, script):
    """On CUDA (graphs for base-only decode steps, eager ones with adapters), in float32 token
    for token and in bf16 up to one of PEFT's own near-ties."""
    from tests.worker.parity import assert_greedy_agrees

    directory, hf, adapters = adapters_of("llama")
    runner = ModelRunner(
        RunnerConfig(
            directory,
            device="cuda",
            dtype=dtype,
            block_size=16,
            num_blocks=64,
            enable_lora=True,
            max_loras=4,
            max_lora_rank=16,
            lora_modules=tuple((name, str(path)) for name, (path, _) in adapters.items()),
        ),
    )
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=generator).tolist() for n in (6, 19, 11)]
    scripts = [
        script(f"r{i}-{lora}", prompt, max_new=8, lora=lora, chunk=7 if i == 1 else None)
        for i, prompt in enumerate(prompts)
        for lora in (None, "a0", "a3")
    ]
    outputs = scripted(runner, scripts).run()
    for s in scripts:
        reference = hf if s.lora is None else adapters[s.lora][1]
        on_device = copy.deepcopy(reference).to("cuda", dtype=dtype)  # (the CPU fixtures stay as they are)
        want, logits = hf_greedy_with_logits(on_device, s.prompt, s.max_new)
        assert_greedy_agrees(outputs[s.request_id], want, logits, dtype, min_compared=2, label=s.request_id)


def test_a_plan_naming_an_unknown_adapter_is_refused_unchanged(adapters_of):
    from conveyor.ipc.messages import NewRequestData, SamplingParams
    from conveyor.worker.plan_check import PlanRefused
    from tests.plans import plan

    directory, _, adapters = adapters_of("llama")
    runner = ModelRunner(
        RunnerConfig(
            directory,
            block_size=4,
            num_blocks=16,
            lora_modules=(("a0", str(adapters["a0"][0])),),
        ),
    )
    greedy = SamplingParams(temperature=0.0)
    with pytest.raises(PlanRefused, match="unknown LoRA adapter 'zz'"):
        runner.execute(plan(0, [NewRequestData("x", 0, [5, 6, 7], greedy, [0], 0, 3, lora="zz")]))
    assert runner.slots == []
    result = runner.execute(plan(1, [NewRequestData("y", 0, [5, 6, 7], greedy, [0], 0, 3, lora="a0")]))
    assert result.error is None and result.slots == [0]
