"""Sleep and wake around the decode step's CUDA graphs (worker/sleep.py, engine_control.py):
a sleep drops the graphs and frees the KV cache and the logits buffer; a wake regrows them and
captures the start's graphs again; an 8-bit cache's new scales are captured again too.

The CPU tests check the bookkeeping (what is freed, when graphs are released and captured);
the ``gpu`` ones (``pytest -m gpu``, skipped without CUDA) check a graphs runner's greedy
tokens after a wake equal those before the sleep, and its CUDA memory drops by the cache."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.ipc.messages import SleepEngine, UpdateWeights, WakeEngine
from conveyor.runtime.config import RunnerConfig
from conveyor.worker.cuda_graphs import DecodeGraphs
from conveyor.worker.engine_control import EngineControl
from conveyor.worker.model_runner import ModelRunner
from conveyor.worker.step_buffers import StepBuffers


def _runner(directory, device: str = "cpu", **overrides) -> ModelRunner:
    config = dict(device=device, dtype=torch.float32, block_size=16, num_blocks=64, max_num_seqs=4)
    return ModelRunner(RunnerConfig(directory, **{**config, **overrides}))


def _greedy(runner, scripted, script, seed: int) -> dict[str, list[int]]:
    vocab = runner.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 23, 40)]
    scripts = [script(f"r{i}", prompt, max_new=8, join=i) for i, prompt in enumerate(prompts)]
    return scripted(runner, scripts, seed=seed).run()


class _Counting:
    """Counts a runner's decode-graph captures and releases (the real ones still run)."""

    def __init__(self, runner) -> None:
        self.captured = self.released = 0
        decode = runner.decode
        capture, release = decode.capture_graphs, decode.release_graphs

        def counted_capture():
            self.captured += 1
            capture()

        def counted_release():
            self.released += 1
            release()

        decode.capture_graphs, decode.release_graphs = counted_capture, counted_release


def _scaled_copy(directory, out):
    """The checkpoint in ``directory`` with every weight times 1.5 (larger keys and values: new 8-bit scales)."""
    shutil.copytree(directory, out)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    model.save_pretrained(out)
    return out


def _cache_bytes(runner) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in runner.kv_caches}
    return sum(storages.values())


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_and_wake_captures_the_decode_graphs(level, checkpoint_factory, scripted, script):
    """With graphs off (CPU) the same calls run: a sleep releases the graphs and frees the KV
    cache and the logits buffer; a wake regrows them and captures (once) again; tokens after
    the wake are those before the sleep."""
    directory, _ = checkpoint_factory("llama")
    runner = _runner(directory)
    control, counts = EngineControl(runner), _Counting(runner)
    before = _greedy(runner, scripted, script, seed=0)
    cache_bytes, logits_bytes = _cache_bytes(runner), runner.decode.logits.untyped_storage().nbytes()
    answer = control.apply(SleepEngine("s", level=level))
    assert answer.ok and answer.freed_bytes >= cache_bytes + logits_bytes
    assert _cache_bytes(runner) == 0 and runner.decode.logits.untyped_storage().nbytes() == 0
    assert (counts.released, counts.captured) == (1, 0)
    assert control.apply(WakeEngine("w")).ok
    assert (counts.released, counts.captured) == (1, 1)
    assert _cache_bytes(runner) == cache_bytes and all(not t.any() for t in runner.kv_caches)
    assert _greedy(runner, scripted, script, seed=1) == before


def test_an_update_captures_the_graphs_again_when_8bit_scales_change(checkpoint_factory, tmp_path):
    """The kernels take an 8-bit cache's scales as values, which a captured graph holds: an
    update whose scales differ captures the graphs again; one that leaves them alone does not."""
    directory, _ = checkpoint_factory("llama")
    runner = _runner(directory, kv_cache_dtype="int8")
    control, counts = EngineControl(runner), _Counting(runner)
    start = [layer.kv_scales for layer in runner.model.attention_layers()]
    assert control.apply(UpdateWeights("same", path=str(directory))).ok
    assert counts.captured == 0
    other = _scaled_copy(directory, tmp_path / "scaled")
    assert control.apply(UpdateWeights("scaled", path=str(other))).ok
    assert [layer.kv_scales for layer in runner.model.attention_layers()] != start
    assert counts.captured == 1


def test_an_update_of_quantized_weights_captures_the_graphs_again(checkpoint_factory):
    """A quantized layer's update builds new tensors, which graphs captured before would not read."""
    directory, _ = checkpoint_factory("llama")
    runner = _runner(directory, quantization="int8")
    counts = _Counting(runner)
    assert EngineControl(runner).apply(UpdateWeights("u", path=str(directory))).ok
    assert counts.captured == 1


def test_released_graphs_are_reset_and_captured_under_the_same_keys():
    """:meth:`DecodeGraphs.release` resets and drops every graph (their pool goes with the
    last); the keys a capture then runs are those of the start's."""

    class Graph:
        reset_calls = 0

        def reset(self):
            Graph.reset_calls += 1

    buffers = StepBuffers([1, 2, 4], 2048 // 16, torch.device("cpu"))
    graphs = DecodeGraphs(lambda inputs, bound: None, buffers, [1], [512, 2048], 16, lambda rows, q, bound: bound)
    keys = [key for key, _ in graphs.captures()]
    graphs._graphs = {key: Graph() for key in keys}
    graphs.release()
    assert len(graphs) == 0 and Graph.reset_calls == len(keys)
    assert [key for key, _ in graphs.captures()] == keys


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_graphs_runner_sleeps_frees_the_cache_and_wakes_to_the_same_tokens(
    level, kv_cache_dtype, checkpoint_factory, scripted, script
):
    directory, _ = checkpoint_factory("llama")
    runner = _runner(directory, "cuda", num_blocks=4096, kv_cache_dtype=kv_cache_dtype, pad_decode=True)
    assert runner.decode.graphs is not None and len(runner.decode.graphs) > 0
    keys = sorted(runner.decode.graphs._graphs)
    control = EngineControl(runner)
    before = _greedy(runner, scripted, script, seed=0)
    cache_bytes = _cache_bytes(runner)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    assert control.apply(SleepEngine("s", level=level)).ok
    assert len(runner.decode.graphs) == 0
    assert allocated - torch.cuda.memory_allocated() >= cache_bytes
    assert control.apply(WakeEngine("w")).ok
    assert sorted(runner.decode.graphs._graphs) == keys  # the start's graphs, captured again
    assert _greedy(runner, scripted, script, seed=1) == before
    eager = _runner(directory, "cuda", num_blocks=4096, kv_cache_dtype=kv_cache_dtype, pad_decode=True,
                    enforce_eager=True)  # fmt: skip
    assert _greedy(eager, scripted, script, seed=0) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("kv_cache_dtype", "quantization"), [("int8", "none"), ("auto", "int8")])
def test_an_update_under_graphs_serves_the_new_weights(
    kv_cache_dtype, quantization, checkpoint_factory, scripted, script, tmp_path
):
    """After an update that changes an 8-bit cache's scales, or a quantized model's weights
    (new tensors), the replayed graphs give the tokens a start on the new checkpoint gives
    (eagerly)."""
    directory, _ = checkpoint_factory("llama")
    scaled = _scaled_copy(directory, tmp_path / "scaled")
    options = dict(kv_cache_dtype=kv_cache_dtype, quantization=quantization, pad_decode=True)
    runner = _runner(directory, "cuda", **options)
    assert EngineControl(runner).apply(UpdateWeights("u", path=str(scaled))).ok
    started = _runner(scaled, "cuda", **options, enforce_eager=True)
    assert [layer.kv_scales for layer in runner.model.attention_layers()] == [
        layer.kv_scales for layer in started.model.attention_layers()
    ]
    assert _greedy(runner, scripted, script, seed=0) == _greedy(started, scripted, script, seed=0)
