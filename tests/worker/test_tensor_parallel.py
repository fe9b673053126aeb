"""Tensor parallelism (:mod:`conveyor.worker.parallel`) on CPU with gloo (and, where two
GPUs are lent, with NCCL: ``pytest -m gpu``).

Shards: each rank's parameters are exactly its slice of the unsplit model's (query heads
with their kv heads, replicated when ranks outnumber kv heads; gate/up rows; o/down columns;
everything else whole, the LM head on rank 0 only), its KV cache holds only its kv heads,
and head counts that cannot be split are refused.

Generation: two ranks, each a ModelRunner on the same scheduler-like script (chunked
prefill, a preemption with recompute, requests joining late), give greedy tokens equal to
the unsplit runner's and transformers' for Llama (GQA; with o_proj bias), Qwen2 (q/k/v bias,
tied embeddings) and Qwen3 (q/k norm, one kv head: replicated on both ranks); rank 1 returns
the same results as rank 0. Swaps and prefix reuse run on each rank's own heads. One start
of two ranks runs every case. The CPU ranks are forked, so they inherit the imported torch
and transformers that spawned ones would spend seconds re-importing; each sets one torch
thread first, never using the parent's thread pool.

A rank whose peer never joins a collective raises once the group's timeout passes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.ipc.messages import NewRequestData, SamplingParams
from conveyor.runtime.config import RunnerConfig
from conveyor.worker.attention.torch_ref import TorchReferenceAttention
from conveyor.worker.kv_cache import KVCacheShape
from conveyor.worker.loader import load_model
from conveyor.worker.model_runner import ModelRunner
from conveyor.worker.models.llama import LlamaFamilyModel
from conveyor.worker.parallel import (
    NO_TENSOR_PARALLEL,
    TensorParallel,
    all_reduce_,
    close_tensor_parallel,
    default_backend,
    init_tensor_parallel,
    rank_device,
    shard_heads,
)
from tests.plans import CachedRow, plan
from tests.worker.conftest import Script, ScriptedScheduler
from tests.worker.test_generation import hf_greedy, prompts

BLOCK_SIZE = 4
TP_CHECKPOINTS = ("llama", "llama_mha_bias", "qwen2_tied", "qwen3", "gemma3")


# ---------------------------------------------------------------- shards, in this process


@pytest.mark.parametrize(
    "name, size", [("llama", 2), ("llama", 4), ("llama_mha_bias", 4), ("qwen2_tied", 2), ("qwen3", 2), ("gemma3", 2)]
)
def test_each_rank_loads_exactly_its_slice(name, size, checkpoint_factory):
    directory, _ = checkpoint_factory(name)
    whole, config = load_model(directory)
    ranks = [TensorParallel(rank, size) for rank in range(size)]
    shards = [dict(load_model(directory, tensor_parallel=tp)[0].named_parameters()) for tp in ranks]
    d, heads, kv_heads = config.head_dim, config.num_heads, config.num_kv_heads
    local = heads // size
    for param, full in whole.named_parameters():
        parts = [shard.get(param) for shard in shards]
        if param.endswith("qkv_proj.weight") or param.endswith("qkv_proj.bias"):
            q, k, v = full.split([heads * d, kv_heads * d, kv_heads * d])
            local_kv = max(kv_heads // size, 1)
            for rank, part in enumerate(parts):
                pq, pk, pv = part.split([local * d, local_kv * d, local_kv * d])
                first_q = rank * local
                first_kv = first_q // (heads // kv_heads)  # the kv head the rank's first query head uses
                assert torch.equal(pq, q[first_q * d : (first_q + local) * d]), (param, rank)
                assert torch.equal(pk, k[first_kv * d : (first_kv + local_kv) * d]), (param, rank)
                assert torch.equal(pv, v[first_kv * d : (first_kv + local_kv) * d]), (param, rank)
        elif param.endswith("gate_up_proj.weight"):
            gates, ups = zip(*(part.chunk(2) for part in parts))
            assert torch.equal(torch.cat([torch.cat(gates), torch.cat(ups)]), full), param
        elif param.endswith("o_proj.weight") or param.endswith("down_proj.weight"):
            assert torch.equal(torch.cat(parts, dim=1), full), param
        elif param == "lm_head.weight":
            assert torch.equal(parts[0], full) and all(part is None for part in parts[1:])
        else:  # norms, embedding, o_proj bias: whole on every rank
            assert all(torch.equal(part, full) for part in parts), param
    for tp in ranks:
        assert KVCacheShape.of(config, BLOCK_SIZE, torch.float32, tp).bytes_per_block == (
            KVCacheShape.of(config, BLOCK_SIZE, torch.float32).bytes_per_block * max(kv_heads // size, 1) // kv_heads
        )


@pytest.mark.parametrize(
    "heads, kv_heads, size, message",
    [
        (4, 2, 3, "num_attention_heads 4 does not divide by the tensor-parallel size 3"),
        (6, 2, 3, "num_key_value_heads 2 is fewer than the tensor-parallel size 3 and does not divide it"),
        (12, 6, 4, "num_key_value_heads 6 does not divide by the tensor-parallel size 4"),
    ],
)
def test_heads_that_cannot_be_split_are_refused(heads, kv_heads, size, message):
    with pytest.raises(ValueError, match=message):
        shard_heads(heads, kv_heads, TensorParallel(0, size))


def test_intermediate_size_that_cannot_be_split_is_refused():
    config = ModelConfig.from_dicts(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 32,
            "hidden_size": 16,
            "intermediate_size": 90,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "max_position_embeddings": 8,
        }
    )
    with pytest.raises(ValueError, match="intermediate_size 90 does not divide by the tensor-parallel size 4"):
        LlamaFamilyModel(config, TorchReferenceAttention(), torch.float32, "meta", TensorParallel(0, 4))


def test_rank_outside_the_group_is_refused():
    with pytest.raises(ValueError, match="rank 2 outside 0..1"):
        TensorParallel(2, 2)


# ---------------------------------------------------------------- two ranks


def scripts(vocab_size: int) -> list[Script]:
    p = prompts(vocab_size, [1, 9, 19, 6])
    return [
        Script("one-token", p[0], max_new=5),
        Script("short", p[1], max_new=6),
        Script("chunked", p[2], max_new=4, join=1, chunk=5),
        Script("preempted", p[3], max_new=6, join=2, chunk=4, preempt_after=3),
    ]


def generate(directory: str | Path, tp: TensorParallel, device: str = "cpu") -> dict:
    """The scripted run's outputs by request id, and the kv heads the rank caches."""
    runner = ModelRunner(
        RunnerConfig(
            directory,
            device=rank_device(device, tp),
            block_size=BLOCK_SIZE,
            num_blocks=64,
        ),
        tensor_parallel=tp,
    )
    outputs = ScriptedScheduler(runner, scripts(runner.model_config.vocab_size)).run()
    kv_heads, swap_kv_heads = runner.kv_caches[0].shape[3], runner.swap_caches[0].shape[3]
    return {"outputs": outputs, "kv_heads": kv_heads, "swap_kv_heads": swap_kv_heads}


def swap_and_share(directory: str | Path, tp: TensorParallel, device: str = "cpu") -> dict[str, list[int]]:
    """The greedy outputs of the scripts' 9-token prompt ("short", 6 tokens), generated twice:
    ``swapped`` is swapped out after 3 tokens while another request overwrites its blocks,
    then swapped back into other blocks on another slot; ``shared`` starts from the blocks
    holding the KV of the prompt's first 8 tokens, which ``swapped`` computed."""
    runner = ModelRunner(
        RunnerConfig(
            directory,
            device=rank_device(device, tp),
            block_size=BLOCK_SIZE,
            num_blocks=16,
            num_cpu_blocks=8,
        ),
        tensor_parallel=tp,
    )
    prompt = scripts(runner.model_config.vocab_size)[1].prompt
    greedy = SamplingParams(temperature=0.0)
    out: list[int] = []

    def run(step: int, new=(), cached=(), finished=(), **swaps) -> None:
        out.extend(runner.execute(plan(step, new, cached, finished, **swaps)).sampled_token_ids)

    run(0, [NewRequestData("a", 0, prompt, greedy, [0, 1, 2], 0, 9)])
    run(1, cached=[CachedRow(0, [], 9, 1)])
    run(2, cached=[CachedRow(0, [], 10, 1)])  # 12 tokens known, the KV of 11 in blocks 0-2
    intruder = NewRequestData("b", 0, [1] * 12, greedy, [0, 1, 2], 0, 12)
    runner.execute(plan(3, [intruder], [], [0], swap_out=[[0, 5], [1, 6], [2, 7]]))
    runner.execute(plan(4, finished=[0]))
    resumed = NewRequestData("a", 3, prompt + out, greedy, [9, 10, 11], 11, 1)
    run(5, [resumed], swap_in=[[5, 9], [6, 10], [7, 11]])
    run(6, cached=[CachedRow(3, [12], 12, 1)])
    run(7, cached=[CachedRow(3, [], 13, 1)])
    swapped, out = out, []
    run(8, [NewRequestData("c", 1, prompt, greedy, [9, 10, 13], 8, 1)], finished=[3])
    for step, computed in enumerate(range(9, 14), start=9):
        run(step, cached=[CachedRow(1, [14] if computed == 12 else [], computed, 1)])
    return {"swapped": swapped, "shared": out}


def _generating_rank(
    rank: int, size: int, init_file: str, directories: dict[str, str], out_dir: str, device: str = "cpu"
) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, size, f"file://{init_file}", default_backend(device), timeout_s=60)
    results = {name: generate(directory, tp, device) for name, directory in directories.items()}
    results["swap_and_share"] = swap_and_share(directories["llama"], tp, device)
    close_tensor_parallel(tp)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def two_ranks(checkpoint_factory, tmp_path_factory) -> list[dict]:
    """Each rank's ``generate`` result per checkpoint name."""
    directories = {name: str(checkpoint_factory(name)[0]) for name in TP_CHECKPOINTS}
    out = tmp_path_factory.mktemp("tp2")
    args = (2, str(out / "init"), directories, str(out))
    mp.start_processes(_generating_rank, args=args, nprocs=2, join=True, start_method="fork")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("name", TP_CHECKPOINTS)
def test_two_ranks_generate_the_tokens_of_one_and_of_transformers(name, two_ranks, checkpoint_factory):
    directory, hf_model = checkpoint_factory(name)
    single = generate(directory, NO_TENSOR_PARALLEL)
    rank0, rank1 = two_ranks[0][name], two_ranks[1][name]
    assert rank0["outputs"] == single["outputs"]
    assert rank1["outputs"] == rank0["outputs"]  # rank 0's sampled ids, broadcast
    vocab_size = ModelConfig.from_dir(directory).vocab_size
    for s in scripts(vocab_size):
        assert single["outputs"][s.request_id] == hf_greedy(hf_model, s.prompt, s.max_new), (name, s.request_id)
    kv_heads = ModelConfig.from_dir(directory).num_kv_heads
    for rank in two_ranks:  # each rank caches its own kv heads; a lone kv head on both
        assert rank[name]["kv_heads"] == rank[name]["swap_kv_heads"] == max(kv_heads // 2, 1)


def test_two_ranks_swap_and_share_blocks_each_on_its_own_heads(two_ranks, checkpoint_factory):
    """Swap-outs, swap-ins and prefix reuse run on every rank, each on its own kv heads:
    the tokens are those of the uninterrupted scripted run."""
    reference = generate(checkpoint_factory("llama")[0], NO_TENSOR_PARALLEL)["outputs"]["short"]
    assert len(reference) == 6
    for rank in two_ranks:
        assert rank["swap_and_share"] == {"swapped": reference, "shared": reference}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_over_nccl_generate_the_tokens_of_one(checkpoint_factory, tmp_path):
    """The same script on ``cuda:0`` and ``cuda:1`` over NCCL (Triton kernels on each rank's
    heads), against one GPU. Spawned ranks: CUDA does not survive a fork."""
    directories = {name: str(checkpoint_factory(name)[0]) for name in TP_CHECKPOINTS}
    args = (2, str(tmp_path / "init"), directories, str(tmp_path), "cuda")
    mp.start_processes(_generating_rank, args=args, nprocs=2, join=True, start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for name, directory in directories.items():
        single = generate(directory, NO_TENSOR_PARALLEL, "cuda")
        assert ranks[0][name]["outputs"] == single["outputs"], name
        assert ranks[1][name]["outputs"] == ranks[0][name]["outputs"], name
        if name == "llama":
            reference = single["outputs"]["short"]
            assert all(rank["swap_and_share"] == {"swapped": reference, "shared": reference} for rank in ranks)


# ---------------------------------------------------------------- a silent peer


def _silent_peer_rank(rank: int, init_file: str, out_dir: str) -> None:
    tp = init_tensor_parallel(rank, 2, f"file://{init_file}", "gloo", timeout_s=0.5)
    all_reduce_(torch.ones(1), tp)  # both ranks in step once
    if rank == 1:
        time.sleep(2)  # alive, but never joins the next collective
        return
    try:
        all_reduce_(torch.ones(1), tp)
        outcome = "returned"
    except RuntimeError as error:
        outcome = f"raised: {error}"
    Path(out_dir, "outcome").write_text(outcome)


def test_a_collective_whose_peer_never_joins_raises_after_the_timeout(tmp_path):
    """The group's timeout bounds every collective: a rank never hangs on a stuck peer
    (pytest's timeout catches a hang)."""
    mp.start_processes(
        _silent_peer_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True, start_method="fork"
    )
    outcome = (tmp_path / "outcome").read_text()
    assert outcome.startswith("raised") and "Timed out" in outcome, outcome


@pytest.mark.parametrize(
    "gpus, expected", [(8, ["cuda:2", "cuda:3"]), (2, ["cuda:0", "cuda:1"]), (1, ["cuda:0", "cuda:0"])]
)
def test_a_replicas_ranks_take_gpus_of_their_own_where_there_are_enough(monkeypatch, gpus, expected) -> None:
    """Replica 1 of a --data-parallel-size 2 --tensor-parallel-size 2 server starts at GPU 2;
    with fewer GPUs the replicas wrap around and share them. CPU devices are left alone."""
    from conveyor.cli.serve import build_parser, server_config

    args = build_parser().parse_args(
        ["--model", "demo", "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--device", "cuda"]
    )
    ranks = server_config(args, "/tmp/conveyor-test-run").replica(1).worker_ranks()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    devices = [
        rank_device("cuda", TensorParallel(w.tensor_parallel_rank, 2, None), w.runner.first_device) for w in ranks
    ]
    assert devices == expected
    assert rank_device("cpu", TensorParallel(1, 2, None), 2) == "cpu"


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_worker_makes_its_replicas_gpu_current_before_loading(monkeypatch, tmp_path, tp_size) -> None:
    """Data-parallel replica 1 (first GPU 1, or 2 at tensor-parallel size 2) on a 4-GPU
    machine: the worker's startup makes that GPU current before the model loads, at size 1
    too, so Triton kernels launch on the replica's GPU and not on cuda:0."""
    import conveyor.worker.main as worker_main
    from conveyor.ipc.step_channel import StepChannels
    from conveyor.runtime.config import RunnerConfig, WorkerConfig

    calls: list[str] = []

    class Loaded(Exception):
        pass

    def build_runner(*args, **kwargs):
        calls.append("build_runner")
        raise Loaded

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(f"set_device {torch.device(device)}"))
    monkeypatch.setattr(worker_main, "build_runner", build_runner)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: calls.append("init_process_group"))
    channels = StepChannels.for_server(
        str(tmp_path), "ipc://unused-p", "ipc://unused-r", shm=False, plan_readers=tp_size
    )
    config = WorkerConfig(
        RunnerConfig("unused", device="cuda", first_device=tp_size), None, channels, tensor_parallel_size=tp_size
    )
    with pytest.raises(Loaded):
        worker_main._start(config, None)
    group = ["init_process_group"] if tp_size > 1 else []
    assert calls == [f"set_device cuda:{tp_size}", *group, "build_runner"]
