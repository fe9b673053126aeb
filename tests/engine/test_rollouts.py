"""What an RL trainer drives between training steps (issue 42): weight updates in place (from
a directory, from tensors, from the trainer's broadcast), with requests in flight finishing or
aborted and the prefix cache dropped; sleep (level 1: the KV cache; level 2: the weights too)
and wake, the memory given back measured in the process's RSS."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.worker.weight_updates import WeightBroadcast
from tests.checkpoints import randomize
from tests.engine.conftest import TINY
from tests.trainer_group import trainer_broadcasting

PROMPT = [5, 9, 33, 120, 7, 64, 200, 18]
GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def trained(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint after a "training step": the same model with other weights."""
    directory = tmp_path_factory.mktemp("trained")
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    randomize(model, seed=7)
    model.save_pretrained(directory)
    for file in tiny_checkpoint.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(file, directory / file.name)
    return directory


def hf_greedy(directory) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT) :].tolist()


def greedy(engine) -> list[int]:
    return engine.generate([PROMPT], progress=False, **GREEDY)[0].token_ids


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_an_update_from_disk_serves_the_new_weights(tiny_engine, tiny_checkpoint, trained):
    engine = tiny_engine()
    assert greedy(engine) == hf_greedy(tiny_checkpoint)
    running = engine.add_request(token_ids=PROMPT, **GREEDY)
    engine.step()
    assert engine.update_weights(trained) == 1  # the request in flight finishes first, on version 0
    assert running.done and running.finish_reason == "length" and running.weight_version == 0
    assert running.tokens == hf_greedy(tiny_checkpoint)
    after = engine.add_request(token_ids=PROMPT, **GREEDY)
    while engine.has_pending_requests():
        engine.step()
    assert after.tokens == hf_greedy(trained) and after.weight_version == 1
    assert engine.stats()["held_blocks"] == 0


def test_an_update_from_tensors_can_abort_what_runs(tiny_engine, trained):
    engine = tiny_engine()
    running = engine.add_request(token_ids=PROMPT, **GREEDY)
    engine.step()
    tensors = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).state_dict()
    engine.update_weights(tensors, in_flight="abort")
    assert running.done and running.finish_reason == "abort"
    assert greedy(engine) == hf_greedy(trained)
    with pytest.raises(ValueError, match="missing weights"):
        engine.update_weights({k: v for k, v in tensors.items() if k != "lm_head.weight"})
    assert greedy(engine) == hf_greedy(trained) and engine.weight_version == 1  # refused whole


def test_an_update_from_the_trainers_broadcast(tiny_engine, trained):
    engine = tiny_engine()
    tensors = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).state_dict()
    with trainer_broadcasting(tensors, 2) as (address, specs):
        engine.update_weights(WeightBroadcast(address, 1, 2, specs, timeout_s=60))
    assert greedy(engine) == hf_greedy(trained)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_memory_back_and_wake_serves_again(tiny_engine, tiny_checkpoint, trained, level):
    kv_bytes = 256 << 20  # far above glibc's mmap threshold: freed pages leave the RSS at once
    engine = tiny_engine(num_kv_blocks=None, kv_cache_memory=kv_bytes / 2**30)
    engine.update_weights(trained)  # level 2 forgets these: waking reads the checkpoint again
    for cache in engine.runner.kv_caches:  # a pool in use is resident (it starts as the kernel's zero pages)
        cache.fill_(1.0)
    before = rss_bytes()
    freed = engine.sleep(level)
    assert engine.is_sleeping and freed >= kv_bytes * 0.99
    assert before - rss_bytes() >= 0.8 * kv_bytes
    if level == 2:
        assert all(p.untyped_storage().nbytes() == 0 for p in engine.runner.model.parameters())
    with pytest.raises(ValueError, match="asleep"):
        engine.add_request(token_ids=PROMPT, **GREEDY)
    engine.wake_up()
    assert not engine.is_sleeping
    assert greedy(engine) == hf_greedy(trained if level == 1 else tiny_checkpoint)
    assert engine.weight_version == (1 if level == 1 else 2)


def test_updates_at_two_tensor_parallel_ranks(tiny_engine, tiny_checkpoint, trained):
    """Every source reaches both ranks, each loading its shard: a directory, tensors in the
    engine's process (rank 0 broadcasts them to rank 1), and the trainer's group (rank 0 of a
    world of 3: the engine's ranks are members 1 and 2); then sleep and wake at two ranks."""
    trained_tensors = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).state_dict()
    with tiny_engine(tensor_parallel_size=2, distributed_timeout_s=60) as engine:
        assert engine.update_weights(trained) == 1 and greedy(engine) == hf_greedy(trained)
        original = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).state_dict()
        assert engine.update_weights(original) == 2 and greedy(engine) == hf_greedy(tiny_checkpoint)
        with trainer_broadcasting(trained_tensors, 3) as (address, specs):
            assert engine.update_weights(WeightBroadcast(address, 1, 3, specs, timeout_s=60)) == 3
        assert greedy(engine) == hf_greedy(trained)
        with pytest.raises(ValueError, match="missing weights"):
            engine.update_weights({k: v for k, v in original.items() if k != "lm_head.weight"})
        assert engine.sleep(1) > 0 and engine.is_sleeping
        engine.wake_up()
        assert greedy(engine) == hf_greedy(trained) and engine.weight_version == 3


def kv_scales(engine) -> list:
    layers = [m.attention for m in engine.runner.model.modules() if hasattr(m, "attention")]
    return [(layer.kv_scales.k, layer.kv_scales.v) for layer in layers if hasattr(layer, "kv_scales")]


def test_an_update_recalibrates_an_8bit_kv_cache(tiny_engine, tiny_checkpoint, trained):
    """The scales after an update are those a start on the new checkpoint measures, and so
    are the tokens."""
    engine = tiny_engine(kv_cache_dtype="int8")
    before = kv_scales(engine)
    engine.update_weights(trained)
    started = type(engine)(trained, **{**TINY, "kv_cache_dtype": "int8"})
    assert kv_scales(engine) == kv_scales(started) != before and len(before) == engine.model_config.num_layers
    assert greedy(engine) == greedy(started)
    engine.sleep(2)  # waking reads the start's checkpoint again, and measures its scales again
    engine.wake_up()
    assert kv_scales(engine) == before
