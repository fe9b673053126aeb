"""Mixture-of-experts models through the fused kernels (interpreted on CPU tensors, as CUDA runs
them): logits equal transformers'. Split over two ranks (gloo, CPU): tensor-sliced experts (each rank
a share of every expert's features) and expert-parallel (each rank half the experts whole),
each giving the greedy tokens of one rank and of transformers on the scheduler-like script of
tests/worker/test_tensor_parallel.py (chunked prefill, preemption with recompute, late joins).
Each rank's shard holds exactly its experts' slices; what cannot be split is refused. Swaps
and prefix reuse on one rank give the uninterrupted run's tokens."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.kernels import layer_ops
from conveyor.runtime.tensor_shards import check_shardable
from conveyor.worker.kv_cache import KVCacheShape
from conveyor.worker.loader import load_model
from conveyor.worker.models.moe import SparseMoe
from conveyor.worker.parallel import NO_TENSOR_PARALLEL, TensorParallel, close_tensor_parallel, init_tensor_parallel
from tests.worker.test_generation import hf_greedy
from tests.worker.test_model import BLOCK_SIZE, forward_logits
from tests.worker.test_tensor_parallel import generate, scripts, swap_and_share

MOE_CHECKPOINTS = ("qwen3_moe", "mixtral")


@pytest.mark.parametrize("name", MOE_CHECKPOINTS)
def test_fused_kernels_in_the_model_match_transformers(name, checkpoint_factory, monkeypatch):
    """The CUDA path (norms, SiLU-mul and the fused MoE kernels), interpreted: a prefill of
    one prompt continued beside a fresh one, each row's logits equal transformers'."""
    directory, hf_model = checkpoint_factory(name)
    monkeypatch.setattr(layer_ops, "_use_triton", lambda x: True)
    model, config = load_model(directory)
    model.bind_kv_cache(KVCacheShape.of(config, BLOCK_SIZE, torch.float32).allocate(16, "cpu"))
    generator = torch.Generator().manual_seed(2)
    long, short = (torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in (11, 5))
    forward_logits(model, BLOCK_SIZE, [6], [0], [[7, 2, 11]], long[:6])
    logits = forward_logits(model, BLOCK_SIZE, [5, 5], [6, 0], [[7, 2, 11], [5, 9]], long[6:] + short)
    with torch.no_grad():
        want_long, want_short = (hf_model(torch.tensor([p])).logits[0].float() for p in (long, short))
    torch.testing.assert_close(logits[:5], want_long[6:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[5:], want_short, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", MOE_CHECKPOINTS)
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_loads_exactly_its_experts(name, expert_parallel, checkpoint_factory):
    directory, _ = checkpoint_factory(name)
    whole, config = load_model(directory)
    shards = [
        load_model(directory, tensor_parallel=TensorParallel(r, 2, expert_parallel=expert_parallel))[0]
        for r in range(2)
    ]
    experts, width = config.moe.num_experts, config.moe.intermediate_size
    for i, layer in enumerate(whole.layers):
        if not isinstance(layer.mlp, SparseMoe):
            continue
        full13 = layer.mlp.w13.view(experts, 2 * width, -1)
        full2 = layer.mlp.w2.view(experts, config.hidden_size, width)
        parts = [shard.layers[i].mlp for shard in shards]
        assert all(torch.equal(part.gate.weight, layer.mlp.gate.weight) for part in parts)
        if expert_parallel:  # half the experts each, whole
            assert torch.equal(torch.cat([p.w13 for p in parts]), layer.mlp.w13)
            assert torch.equal(torch.cat([p.w2 for p in parts]), layer.mlp.w2)
        else:  # every expert, half its features each: gate rows then up rows; down columns
            w13 = [p.w13.view(experts, width, -1) for p in parts]
            gates = torch.cat([w[:, : width // 2] for w in w13], dim=1)
            ups = torch.cat([w[:, width // 2 :] for w in w13], dim=1)
            assert torch.equal(torch.cat([gates, ups], dim=1), full13)
            assert torch.equal(torch.cat([p.w2.view(experts, config.hidden_size, -1) for p in parts], dim=2), full2)


def test_experts_that_cannot_be_split_are_refused(checkpoint_factory):
    config = ModelConfig.from_dir(checkpoint_factory("mixtral")[0])  # 8 experts of 48, 4 heads over 2 kv heads
    odd = dataclasses.replace(config, moe=dataclasses.replace(config.moe, num_experts=6, intermediate_size=42))
    with pytest.raises(ValueError, match="--model x: num_experts 6 does not divide by the tensor-parallel size 4"):
        check_shardable(odd, 4, "--model x", expert_parallel=True)
    with pytest.raises(
        ValueError, match="--model x: moe intermediate_size 42 does not divide by the tensor-parallel size 4"
    ):
        check_shardable(odd, 4, "--model x")
    check_shardable(config, 4, "--model x", expert_parallel=True)
    check_shardable(config, 4, "--model x")


def test_swaps_and_prefix_reuse_keep_the_tokens(checkpoint_factory, one_rank):
    directory, _ = checkpoint_factory("qwen3_moe")
    reference = one_rank["qwen3_moe"]["short"]
    assert swap_and_share(directory, NO_TENSOR_PARALLEL) == {"swapped": reference, "shared": reference}


def _rank(rank: int, init_file: str, directories: dict[str, str], out_dir: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, 2, f"file://{init_file}", "gloo", timeout_s=60)
    results = {}
    for expert_parallel in (False, True):
        split = dataclasses.replace(tp, expert_parallel=expert_parallel)
        for name, directory in directories.items():
            results[f"{name}/{expert_parallel}"] = generate(directory, split)["outputs"]
    close_tensor_parallel(tp)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def two_ranks(checkpoint_factory, tmp_path_factory) -> list[dict]:
    directories = {name: str(checkpoint_factory(name)[0]) for name in MOE_CHECKPOINTS}
    out = tmp_path_factory.mktemp("moe-tp2")
    mp.start_processes(_rank, args=(str(out / "init"), directories, str(out)), nprocs=2, join=True, start_method="fork")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("name", MOE_CHECKPOINTS)
def test_one_rank_generates_the_tokens_of_transformers(name, one_rank, checkpoint_factory):
    directory, hf_model = checkpoint_factory(name)
    for s in scripts(ModelConfig.from_dir(directory).vocab_size):
        assert one_rank[name][s.request_id] == hf_greedy(hf_model, s.prompt, s.max_new), (name, s.request_id)


@pytest.fixture(scope="module")
def one_rank(checkpoint_factory) -> dict[str, dict]:
    return {name: generate(checkpoint_factory(name)[0], NO_TENSOR_PARALLEL)["outputs"] for name in MOE_CHECKPOINTS}


@pytest.mark.parametrize("name", MOE_CHECKPOINTS)
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_generate_the_tokens_of_one(name, expert_parallel, two_ranks, one_rank):
    key = f"{name}/{expert_parallel}"
    assert two_ranks[0][key] == one_rank[name] and two_ranks[1][key] == one_rank[name]


def test_serve_passes_expert_parallel_to_every_rank(checkpoint_factory, tmp_path):
    from conveyor.cli import serve

    directory = str(checkpoint_factory("mixtral")[0])
    args = serve.build_parser().parse_args(["--model", directory, "--tensor-parallel-size", "2", "--expert-parallel"])
    config = serve.server_config(args, str(tmp_path / "run"))
    assert all(worker.expert_parallel for worker in config.worker_ranks())
