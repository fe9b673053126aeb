"""LoRA adapters under tensor parallelism: two gloo ranks (forked, as in
test_tensor_parallel.py), each holding its shard of every adapter (B of q/k/v and gate/up by
its output rows, A of o/down by its input columns), generate the greedy tokens of HF
transformers with PEFT, adapters and the base model mixed in one batch, for Llama and for
Qwen3 (one kv head, replicated on both ranks: its k/v adapter rows too)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.multiprocessing as mp

from conveyor.ipc.messages import SamplingParams
from conveyor.runtime.config import RunnerConfig
from conveyor.worker.model_runner import ModelRunner
from conveyor.worker.parallel import close_tensor_parallel, init_tensor_parallel
from tests.lora_adapters import make_adapter
from tests.worker.conftest import Script, ScriptedScheduler
from tests.worker.parity import hf_greedy_with_logits

FAMILIES = ("llama", "qwen3")
LORAS = [None, "x", "y", "x"]


def _scripts() -> list[Script]:
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (7, 13, 10, 5)]
    return [
        Script(
            f"r{i}",
            prompt,
            max_new=6,
            chunk=4 if i == 1 else None,
            join=i % 2,
            lora=lora,
            preempt_after=2 if i == 2 else None,
            sampling=SamplingParams(temperature=0.0),
        )
        for i, (prompt, lora) in enumerate(zip(prompts, LORAS))
    ]


def _rank(rank: int, init_file: str, cases: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, 2, f"file://{init_file}", "gloo", timeout_s=60)
    results = {}
    for family, (directory, adapters) in cases.items():
        runner = ModelRunner(
            RunnerConfig(
                directory,
                block_size=4,
                num_blocks=64,
                enable_lora=True,
                max_loras=2,
                max_lora_rank=16,
                lora_modules=tuple(adapters.items()),
            ),
            tensor_parallel=tp,
        )
        results[family] = ScriptedScheduler(runner, _scripts()).run()
    close_tensor_parallel(tp)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def test_two_ranks_with_adapters_match_peft(checkpoint_factory, tmp_path):
    cases, references = {}, {}
    for family in FAMILIES:
        directory, hf = checkpoint_factory(family)
        adapters, refs = {}, {None: hf}
        for i, name in enumerate(("x", "y")):
            path = tmp_path / f"{family}-{name}"
            refs[name] = make_adapter(hf, path, seed=20 + i, rank=8 if i else 16)
            adapters[name] = str(path)
        cases[family] = (str(directory), adapters)
        references[family] = refs
    mp.start_processes(
        _rank, args=(str(tmp_path / "init"), cases, str(tmp_path)), nprocs=2, join=True, start_method="fork"
    )
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for family in FAMILIES:
        assert ranks[1][family] == ranks[0][family]
        for s in _scripts():
            want, _ = hf_greedy_with_logits(references[family][s.lora], s.prompt, s.max_new)
            assert ranks[0][family][s.request_id] == want, (family, s.request_id, s.lora)


def _load_rank(rank: int, init_file: str, directory: str, good: str, out_dir: str) -> None:
    from conveyor.worker.lora import LoraLoadError

    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, 2, f"file://{init_file}", "gloo", timeout_s=60)
    runner = ModelRunner(
        RunnerConfig(
            directory,
            block_size=4,
            num_blocks=16,
            enable_lora=True,
            max_loras=1,
        ),
        tensor_parallel=tp,
    )
    outcome = []
    # Rank 1 misses the files of the first load: neither rank takes it, each says why.
    for name, path in (("x", good if rank == 0 else good + "-elsewhere"), ("y", good)):
        try:
            runner.adapters.load_lora(name, path)
            outcome.append([name, "loaded"])
        except LoraLoadError as exc:
            outcome.append([name, str(exc)])
    outcome.append(runner.lora.names)
    close_tensor_parallel(tp)
    Path(out_dir, f"load{rank}.json").write_text(json.dumps(outcome))


def test_a_load_is_taken_by_every_rank_or_none(checkpoint_factory, tmp_path):
    directory, hf = checkpoint_factory("llama")
    make_adapter(hf, tmp_path / "adapter", seed=30, rank=8)
    mp.start_processes(
        _load_rank,
        args=(str(tmp_path / "init"), str(directory), str(tmp_path / "adapter"), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="fork",
    )
    first, second = (json.loads((tmp_path / f"load{rank}.json").read_text()) for rank in range(2))
    assert first[0] == ["x", "adapter 'x' could not be loaded on another tensor-parallel rank (see its log)"]
    assert second[0][0] == "x" and "missing file" in second[0][1]
    assert first[1:] == second[1:] == [["y", "loaded"], ["y"]]
