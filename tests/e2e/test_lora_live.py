"""LoRA adapters loaded and unloaded over ZeroMQ while bin/serve serves (two data-parallel
replicas, so every update must reach both): a loaded adapter's greedy tokens equal HF
transformers with PEFT on each replica, bad adapters are refused with their reason while a
stream goes on, an adapter in use cannot be unloaded, an unloaded one is refused, a name
loaded again serves its new weights, and no KV block is left held. With two tensor-parallel
ranks (the asyncio client), both ranks take a load and serve it, also once its directory is
deleted and its host copy evicted (read once, kept in the worker's spill file)."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

from conveyor.client import AsyncClient, Client, ServerError
from tests.lora_adapters import make_adapter, spoiled_copy

PROMPT = [5, 17, 29, 41, 53, 65, 77, 89, 101]
SERVE_ARGS = ("--num-kv-blocks", "96", "--block-size", "8", "--threads", "1", "--max-num-batched-tokens", "256")


def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def refused(call, code: str, *words: str) -> None:
    with pytest.raises(ServerError) as caught:
        call()
    assert caught.value.code == code, caught.value
    for word in words:
        assert word in str(caught.value), caught.value


def test_load_serve_unload_over_zeromq(serve_factory, tiny_checkpoint, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    base.generation_config.eos_token_id = None
    first = make_adapter(base, tmp_path / "first", seed=5, rank=8)
    second = make_adapter(base, tmp_path / "second", seed=6, rank=4, targets=["q_proj", "v_proj", "down_proj"])
    make_adapter(base, tmp_path / "wide", seed=7, rank=32)
    server = serve_factory(
        "--model",
        str(tiny_checkpoint),
        *SERVE_ARGS,
        "--data-parallel-size",
        "2",
        "--enable-lora-loading",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
    )
    request = {"token_ids": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with Client(server.address) as client, Client(server.address) as other:
        stream = other.stream(token_ids=PROMPT, max_tokens=200, temperature=0, ignore_eos=True)
        first_delta = next(stream)
        assert first_delta.finish_reason is None, first_delta
        streamed = list(first_delta.token_ids)
        # Bad loads, each refused with its reason, while the base-model stream goes on.
        refused(lambda: client.load_lora("wide", tmp_path / "wide"), "invalid_lora", "rank 32", "--max-lora-rank 16")
        target = spoiled_copy(tmp_path / "first", tmp_path / "target", "target")
        refused(lambda: client.load_lora("target", target), "invalid_lora", "fc_in", "the model lacks")
        shape = spoiled_copy(tmp_path / "first", tmp_path / "shape", "shape")
        refused(lambda: client.load_lora("shape", shape), "invalid_lora", "another base model")
        refused(lambda: client.load_lora("gone", tmp_path / "nowhere"), "lora_not_found", "missing file")
        stats = client.stats()
        assert stats["lora_adapters"] == [] and stats["num_running"] == 1  # the stream still runs
        for delta in stream:
            streamed += delta.token_ids
        assert delta.finish_reason == "length" and streamed == greedy(base, PROMPT, 200)

        loaded = client.load_lora("a", tmp_path / "first")
        assert (loaded["type"], loaded["lora_name"], loaded["loaded"]) == ("lora", "a", True)
        refused(lambda: client.load_lora("a", tmp_path / "second"), "lora_already_loaded", "'a'")
        stats = client.stats()
        assert stats["lora_adapters"] == ["a"] and [r["lora_adapters"] for r in stats["replicas"]] == [["a"], ["a"]]
        want_first = greedy(first, PROMPT, 8)
        assert want_first != greedy(base, PROMPT, 8)
        before = [r["routed"] for r in stats["replicas"]]
        for _ in range(2):  # an idle server routes round robin: one request per replica
            assert client.generate(**request, lora="a").token_ids == want_first
        assert [r["routed"] - b for r, b in zip(client.stats()["replicas"], before)] == [1, 1]

        # An adapter in use is not unloaded; once its request is done, it is.
        running = other.stream(token_ids=PROMPT, max_tokens=100, temperature=0, ignore_eos=True, lora="a")
        tokens = list(next(running).token_ids)
        refused(lambda: client.unload_lora("a"), "lora_in_use", "in use by 1 live request")
        assert [r["lora_adapters"] for r in client.stats()["replicas"]] == [["a"], ["a"]]  # both kept it
        for delta in running:
            tokens += delta.token_ids
        assert delta.finish_reason == "length" and tokens[:8] == want_first
        assert client.unload_lora("a")["loaded"] is False
        failed = client.generate(**request, lora="a")
        assert failed.finish_reason == "error" and "unknown LoRA adapter 'a'" in failed.error
        refused(lambda: client.unload_lora("a"), "lora_not_found", "'a'")

        # The name again, other weights: their tokens, not the prefix cache of the first.
        client.load_lora("a", tmp_path / "second")
        for _ in range(2):
            assert client.generate(**request, lora="a").token_ids == greedy(second, PROMPT, 8)
        assert client.generate(**request).token_ids == greedy(base, PROMPT, 8)
        stats = client.stats()
        assert stats["held_blocks"] == 0 and stats["free_blocks"] + stats["cached_blocks"] == stats["total_blocks"]


def test_two_tensor_parallel_ranks_load_it(serve_factory, tiny_checkpoint, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    base.generation_config.eos_token_id = None
    peft = make_adapter(base, tmp_path / "tp", seed=11, rank=8)
    other = make_adapter(base, tmp_path / "other", seed=12, rank=4)
    shape = spoiled_copy(tmp_path / "tp", tmp_path / "shape", "shape")
    server = serve_factory(
        "--model",
        str(tiny_checkpoint),
        *SERVE_ARGS,
        "--tensor-parallel-size",
        "2",
        "--distributed-timeout",
        "30",
        "--enable-lora-loading",
        "--max-loras",
        "1",
        "--max-cpu-loras",
        "1",
    )

    async def main() -> list[list[int]]:
        async with AsyncClient(server.address, timeout=120) as client:
            with pytest.raises(ServerError) as caught:
                await client.load_lora("tp", shape)
            assert caught.value.code == "invalid_lora" and "another base model" in str(caught.value)
            tokens = []
            for name in ("tp", "other"):  # read once: their directories may go at once
                assert (await client.load_lora(name, tmp_path / name))["loaded"] is True
                shutil.rmtree(tmp_path / name)
            for name in ("tp", "other", "tp"):  # one host copy and one slot: each evicts the other
                request = dict(token_ids=PROMPT, max_tokens=8, temperature=0, ignore_eos=True, lora=name)
                tokens.append((await client.generate(**request)).token_ids)
            assert (await client.unload_lora("tp"))["loaded"] is False
            return tokens

    want_tp, want_other = greedy(peft, PROMPT, 8), greedy(other, PROMPT, 8)
    assert want_tp != want_other and asyncio.run(main()) == [want_tp, want_other, want_tp]
