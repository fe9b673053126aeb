"""``conveyor.Engine`` with LoRA adapters: requests of two adapters and the base model in one
batch, through preemption, each equal to HF transformers with PEFT; an unknown adapter is
the server's error."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import GREEDY, run_all
from tests.lora_adapters import make_adapter


def _peft_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_adapters_and_base_share_steps_through_preemption(preemption, tiny_engine, tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    base.generation_config.eos_token_id = None
    refs = {None: base}
    for i, name in enumerate(["alpha", "beta"]):
        refs[name] = make_adapter(base, tmp_path / name, seed=10 + i, rank=8)
    engine = tiny_engine(
        lora_modules={name: str(tmp_path / name) for name in ("alpha", "beta")},
        max_loras=2,
        num_kv_blocks=16,
        preemption=preemption,
        num_cpu_blocks=64,
    )
    prompt = [5 + (7 * i) % 300 for i in range(13)]
    loras = [None, "alpha", "beta", "alpha", None, "beta"]
    requests = [
        engine.add_request(token_ids=prompt, request_id=f"r{i}", max_tokens=12, lora=lora, **GREEDY)
        for i, lora in enumerate(loras)
    ]
    outs = run_all(engine)
    assert max(out.batch.batch_size for out in outs if out.batch) >= 4  # base and both adapters in one step
    assert engine.scheduler.stats()[f"num_preemptions_{preemption}"] > 0
    want = {lora: _peft_greedy(model, prompt, 12) for lora, model in refs.items()}
    assert len({tuple(tokens) for tokens in want.values()}) == 3  # the adapters change the tokens
    for request, lora in zip(requests, loras):
        assert request.done and request.tokens == want[lora], (request, lora)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'gamma'"):
        engine.add_request(token_ids=prompt, request_id="bad", max_tokens=2, lora="gamma")


def test_load_and_unload_while_serving(tiny_engine, tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    from conveyor.worker.lora import LoraLoadError

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    base.generation_config.eos_token_id = None
    first = make_adapter(base, tmp_path / "first", seed=30, rank=8)
    second = make_adapter(base, tmp_path / "second", seed=31, rank=8)
    engine = tiny_engine(enable_lora=True, max_loras=1, max_lora_rank=8)
    prompt = [9 + (11 * i) % 300 for i in range(17)]
    with pytest.raises(LoraLoadError, match="rank 16 is over --max-lora-rank 8"):
        engine.load_lora("big", _adapter_of_rank(base, tmp_path / "big", 16))
    with pytest.raises(LoraLoadError, match="missing file"):
        engine.load_lora("none", tmp_path / "nowhere")

    def tokens(lora):
        request = engine.add_request(token_ids=prompt, max_tokens=6, lora=lora, **GREEDY)
        run_all(engine)
        return request.tokens

    assert tokens(None) == _peft_greedy(base, prompt, 6)  # it serves on after failed loads
    engine.load_lora("ft", tmp_path / "first")
    assert tokens("ft") == _peft_greedy(first, prompt, 6)
    running = engine.add_request(token_ids=prompt, max_tokens=6, lora="ft", **GREEDY)
    with pytest.raises(ValueError, match="in use by 1 live request"):
        engine.unload_lora("ft")
    run_all(engine)
    assert running.done
    engine.unload_lora("ft")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'ft'"):
        engine.add_request(token_ids=prompt, max_tokens=2, lora="ft")
    # the name again, other weights: the first one's cached prompt blocks must not be reused
    engine.load_lora("ft", tmp_path / "second")
    assert tokens("ft") == _peft_greedy(second, prompt, 6) != _peft_greedy(first, prompt, 6)


def _adapter_of_rank(base, directory, rank):
    make_adapter(base, directory, seed=40, rank=rank)
    return directory


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_adapters_and_base_share_steps_like_peft(dtype, tiny_engine, tiny_checkpoint, tmp_path):
    """The Triton kernels through the engine on CUDA (decode steps with adapter rows eager,
    base-only ones on graphs): float32 token for token, bf16 up to one of PEFT's own near-ties."""
    import copy

    from transformers import AutoModelForCausalLM

    from tests.worker.parity import assert_greedy_agrees, hf_greedy_with_logits

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    base.generation_config.eos_token_id = None
    refs = {None: base}
    for i, name in enumerate(["alpha", "beta"]):
        refs[name] = make_adapter(
            base,
            tmp_path / name,
            seed=50 + i,
            rank=8,
            targets=None if i == 0 else ["q_proj", "v_proj", "up_proj", "down_proj"],
        )
    engine = tiny_engine(
        device="cuda",
        dtype=str(dtype).removeprefix("torch."),
        block_size=16,
        lora_modules={name: str(tmp_path / name) for name in ("alpha", "beta")},
        max_loras=2,
    )
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (7, 21, 12, 30, 9, 16)]
    loras = [None, "alpha", "beta", "alpha", None, "beta"]
    requests = [
        engine.add_request(token_ids=p, request_id=f"r{i}", max_tokens=10, lora=lora, **GREEDY)
        for i, (p, lora) in enumerate(zip(prompts, loras))
    ]
    outs = run_all(engine)
    assert max(out.batch.batch_size for out in outs if out.batch) >= 4  # base and both adapters in one step
    for request, prompt, lora in zip(requests, prompts, loras):
        on_device = copy.deepcopy(refs[lora]).to("cuda", dtype=dtype)
        want, logits = hf_greedy_with_logits(on_device, prompt, 10)
        assert request.done
        assert_greedy_agrees(request.tokens, want, logits, dtype, min_compared=3, label=f"{request.request_id} {lora}")
