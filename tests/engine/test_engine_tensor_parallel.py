"""``conveyor.Engine(tensor_parallel_size=2)`` on CPU (gloo): this process is rank 0, rank 1 a
worker process the engine starts (bin/serve's worker entry), fed every plan on a shared-memory
ring. Greedy outputs equal one rank's and HF transformers', a seeded sampled request one
rank's, requests added between steps stream as with one rank, a LoRA adapter loaded while
serving gives PEFT's tokens and a refused load leaves the ranks in step; close() (and the
interpreter's exit, without close) leaves no rank process, no ring and no run directory; a
killed rank makes the next step raise RanksFailed at once, and a rank dead before the group
met ends the start at once. One engine of two ranks serves the first tests (one process
group per process: the later ones close it first)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conveyor.engine.ranks import RanksFailed
from conveyor.ipc import step_channel
from conveyor.ipc.shm_ring import pid_alive
from tests.engine.conftest import GREEDY, TINY, run_all
from tests.engine.test_engine import prompt

CONFIG = dict(TINY, threads=1, max_batch_size=4, max_batch_tokens=24)
TP = dict(tensor_parallel_size=2, distributed_timeout_s=30)
LORA = dict(enable_lora=True, max_lora_rank=8)
PROMPTS = [prompt(i) for i in range(5)]
SAMPLED = dict(temperature=0.9, top_p=0.9, top_k=40, seed=11, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tp_engine(tiny_checkpoint):
    from conveyor import Engine

    engine = Engine(tiny_checkpoint, **CONFIG, **TP, **LORA)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def single_engine(tiny_checkpoint):
    from conveyor import Engine

    return Engine(tiny_checkpoint, **CONFIG, **LORA)


def leftovers(ranks) -> dict:
    """What a rank group holds on the machine: live rank processes, ring files (in the run
    directory or /dev/shm, named after it), the run directory."""
    tag = os.path.basename(ranks.run_dir)
    shm = [name for name in os.listdir("/dev/shm") if name.startswith(tag)] if os.path.isdir("/dev/shm") else []
    return {
        "processes": [proc.pid for proc in ranks.procs if pid_alive(proc.pid)],
        "rings": step_channel.ring_files(ranks.channels) + shm,
        "run_dir": os.path.exists(ranks.run_dir),
    }


def test_greedy_generate_equals_one_rank_and_hf(tp_engine, single_engine, hf_greedy):
    assert tp_engine.config.num_blocks == single_engine.config.num_blocks == CONFIG["num_kv_blocks"]
    held = leftovers(tp_engine._ranks)
    assert len(held["processes"]) == 1 and held["rings"] and held["run_dir"]
    results = tp_engine.generate(PROMPTS, progress=False, max_tokens=10, **GREEDY)
    single = single_engine.generate(PROMPTS, progress=False, max_tokens=10, **GREEDY)
    for i, (ours, one) in enumerate(zip(results, single)):
        assert ours.outputs[0].token_ids == one.outputs[0].token_ids == hf_greedy(PROMPTS[i], 10), i


def test_seeded_sampled_request_equals_one_rank(tp_engine, single_engine):
    outputs = []
    for engine in (tp_engine, single_engine):
        results = engine.generate(PROMPTS[:3], progress=False, n=2, **SAMPLED)
        outputs.append([[choice.token_ids for choice in result.outputs] for result in results])
    assert outputs[0] == outputs[1]
    assert outputs[0][0][0] != outputs[0][0][1]  # (two seeds: really sampled)


def test_requests_added_between_steps_stream_as_one_rank(tp_engine, hf_greedy):
    requests, streamed = {}, {}

    def take(outs) -> None:
        for out in outs:
            for request in out.requests:
                streamed[int(request.request_id[1:])] += request.take_new().token_ids

    for i in range(4):
        requests[i] = tp_engine.add_request(token_ids=PROMPTS[i], request_id=f"s{i}", max_tokens=6 + i, **GREEDY)
        streamed[i] = []
        if i % 2:  # two requests, a step, two more while the first two decode
            take([tp_engine.step()])
    take(run_all(tp_engine))
    for i, request in requests.items():
        assert request.done and request.finish_reason == "length", request
        assert streamed[i] == request.tokens == hf_greedy(PROMPTS[i], 6 + i), i
        request.remove()
    assert tp_engine.stats()["held_blocks"] == 0


def test_lora_loaded_and_unloaded_on_every_rank(tp_engine, tiny_checkpoint, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from conveyor.worker.lora import LoraLoadError
    from tests.engine.test_lora_engine import _peft_greedy
    from tests.lora_adapters import make_adapter

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    adapter = make_adapter(base, tmp_path / "ft", seed=60, rank=8)
    with pytest.raises(LoraLoadError, match="missing file"):  # refused on every rank alike
        tp_engine.load_lora("none", tmp_path / "nowhere")
    tp_engine.load_lora("ft", tmp_path / "ft")
    results = tp_engine.generate([PROMPTS[2]], progress=False, max_tokens=8, lora="ft", **GREEDY)
    assert results[0].outputs[0].token_ids == _peft_greedy(adapter, PROMPTS[2], 8) != _peft_greedy(base, PROMPTS[2], 8)
    tp_engine.unload_lora("ft")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'ft'"):
        tp_engine.add_request(token_ids=PROMPTS[2], max_tokens=2, lora="ft")
    tp_engine.load_lora("ft", tmp_path / "ft")  # (the ranks freed it too: its slot is there again)
    tp_engine.unload_lora("ft")


def test_a_second_tensor_parallel_engine_waits_for_the_first_to_close(tp_engine, tiny_checkpoint):
    from conveyor import Engine

    with pytest.raises(ValueError, match="one tensor-parallel engine per process at a time"):
        Engine(tiny_checkpoint, **CONFIG, **TP)
    assert tp_engine.generate([PROMPTS[0]], progress=False, max_tokens=2)  # the first serves on


def test_close_leaves_no_process_nor_ring(tp_engine):
    ranks = tp_engine._ranks
    assert leftovers(ranks)["processes"]
    tp_engine.close()
    assert leftovers(ranks) == {"processes": [], "rings": [], "run_dir": False}
    assert ranks.procs[0].exitcode == 0  # (stopped by its Shutdown, not killed)
    tp_engine.close()  # idempotent
    with pytest.raises(RanksFailed, match="closed"):
        tp_engine.step()


def test_a_killed_rank_fails_the_next_step_at_once(tp_engine, tiny_checkpoint):
    from conveyor import Engine

    tp_engine.close()  # (one tensor-parallel engine per process at a time)
    with Engine(tiny_checkpoint, **CONFIG, **TP) as engine:
        ranks = engine._ranks
        from conveyor.worker.lora import LoraLoadError

        with pytest.raises(LoraLoadError, match="LoRA is off"):  # every rank refuses: they stay in step
            engine.load_lora("ft", "/nowhere")
        request = engine.add_request(token_ids=PROMPTS[1], max_tokens=30, **GREEDY)
        engine.step()
        engine.step()
        os.kill(ranks.procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RanksFailed, match=r"rank 1 \(pid \d+, exit code -9\) died.*close it"):
            engine.step()
        assert time.monotonic() - start < TP["distributed_timeout_s"] / 2
        with pytest.raises(RanksFailed, match="rank 1"):  # and every later step
            engine.step()
        assert not request.done
    assert leftovers(ranks) == {"processes": [], "rings": [], "run_dir": False}


def test_interpreter_exit_without_close_stops_the_ranks(tiny_checkpoint):
    script = textwrap.dedent(
        f"""
        from conveyor import Engine
        engine = Engine({str(tiny_checkpoint)!r}, **{CONFIG!r}, **{TP!r})
        engine.generate([[5, 6, 7]], progress=False, max_tokens=3)
        ranks = engine._ranks
        print(ranks.procs[0].pid, ranks.run_dir, ranks.channels.plans.ring_path)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    pid, run_dir, ring = run.stdout.split()
    deadline = time.monotonic() + 5
    while pid_alive(int(pid)) and time.monotonic() < deadline:  # (a daemon: terminated at exit)
        time.sleep(0.05)
    assert not pid_alive(int(pid))
    assert not os.path.exists(run_dir) and not os.path.exists(ring)


def test_a_script_without_a_main_guard_fails_at_once(tiny_checkpoint, tmp_path):
    script = tmp_path / "unguarded.py"  # each spawned rank runs it again, and fails starting ranks of its own
    script.write_text(f"from conveyor import Engine\nEngine({str(tiny_checkpoint)!r}, **{CONFIG!r}, **{TP!r})\n")
    start = time.monotonic()
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and time.monotonic() - start < TP["distributed_timeout_s"]
    assert "RanksFailed: tensor-parallel rank 1" in run.stderr and 'needs `if __name__ == "__main__":`' in run.stderr


def test_refused_before_any_rank_starts(tiny_checkpoint):
    from conveyor import Engine

    with pytest.raises(ValueError, match="num_attention_heads 4 does not divide by the tensor-parallel size 3"):
        Engine(tiny_checkpoint, **CONFIG, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer of at least 1"):
        Engine(tiny_checkpoint, **CONFIG, tensor_parallel_size=0)


def test_cuda_needs_a_gpu_per_rank(tiny_checkpoint, monkeypatch):
    import torch

    from conveyor import Engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs one GPU per rank: 1 visible"):
        Engine(tiny_checkpoint, **{**CONFIG, "device": "cuda"}, **TP)
