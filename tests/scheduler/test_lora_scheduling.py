"""The scheduler and LoRA adapters: unknown adapters refused, never more distinct adapters
running than the worker's slots (without holding back base-model requests), and prefix-cache
blocks keyed by adapter."""

from __future__ import annotations

from conveyor.ipc.messages import FinishReason
from conveyor.runtime.config import SchedulerConfig
from tests.scheduler.scheduler_harness import Harness


def _config(**kw) -> SchedulerConfig:
    return SchedulerConfig(
        num_blocks=64, block_size=4, max_num_seqs=8, max_model_len=256, lora_names=("a", "b", "c"), **kw
    )


def test_unknown_adapter_is_an_error_output():
    h = Harness(_config())
    out = h.add("x", lora="nope")
    assert out is not None and out.finish_reason == FinishReason.ERROR and "unknown LoRA adapter 'nope'" in out.error
    assert h.add("y", lora="a") is None


def test_running_adapters_never_exceed_slots_and_base_requests_pass():
    h = Harness(_config(max_loras=2))
    for rid, lora in [("ra", "a"), ("rb", "b"), ("rc", "c"), ("base", None), ("ra2", "a")]:
        assert h.add(rid, prompt_len=6, max_tokens=3 if rid in ("ra", "rb") else 6, lora=lora) is None
    first = h.step()
    admitted = {new.request_id: new.lora for new in first.new_requests}
    # c waits for a slot; the base request and a second request of a running adapter pass it
    assert admitted == {"ra": "a", "rb": "b", "base": None, "ra2": "a"}
    seen_c = False
    for _ in range(40):
        plan = h.step()
        if plan is None:
            break
        running = {r.lora for r in h.scheduler.state.table.running if r.lora}
        assert len(running) <= 2
        seen_c |= any(new.request_id == "rc" for new in plan.new_requests)
    assert seen_c  # admitted once a slot's adapter left


def test_prefix_cache_is_keyed_by_adapter():
    h = Harness(_config())
    prompt = list(range(1, 18))
    h.add("base1", prompt=prompt, max_tokens=2)
    h.run()
    hit = {}
    for rid, lora in [("a1", "a"), ("base2", None)]:
        h.add(rid, prompt=prompt, max_tokens=2, lora=lora)
        plan = h.step()
        hit[rid] = {new.request_id: new.num_computed_tokens for new in plan.new_requests}[rid]
        h.run()
    assert hit == {"a1": 0, "base2": 16}
    h.add("a2", prompt=prompt, max_tokens=2, lora="a")  # a's own blocks are found for a
    plan = h.step()
    assert plan.new_requests[0].num_computed_tokens == 16
