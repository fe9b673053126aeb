"""bin/serve with speculative decoding by a draft model (--speculative-method draft
--speculative-model DIR): the worker process loads the draft beside the model (each of two
tensor-parallel ranks its shard of it), greedy streams served concurrently equal HF
transformers' token for token, and the stats count the proposals."""

from __future__ import annotations

import asyncio

import pytest

from conveyor.client import AsyncClient, Client


@pytest.mark.parametrize(
    "ranks", [(), ("--tensor-parallel-size", "2", "--device", "cpu", "--distributed-timeout", "30")], ids=["tp1", "tp2"]
)
def test_draft_speculation_serves_hf_greedy(serve_factory, tiny_checkpoint, draft_checkpoint, hf_greedy, ranks) -> None:
    server = serve_factory(
        "--model", str(tiny_checkpoint), "--num-kv-blocks", "64", "--block-size", "8", "--threads", "1",
        "--speculative-method", "draft", "--speculative-model", str(draft_checkpoint), "--num-speculative-tokens",
        "3", *ranks,
    )  # fmt: skip
    if ranks:
        server._pid_of("worker-rank1")  # (raises unless the second rank started, with its shard of the draft)
    prompts = [[(5 * i + 3 * j) % 300 + 10 for j in range(4 + 3 * i)] for i in range(4)]

    async def run_all():
        async with AsyncClient(server.address, timeout=120) as client:
            return await asyncio.gather(
                *(client.generate(token_ids=p, max_tokens=12, temperature=0, ignore_eos=True) for p in prompts)
            )

    results = asyncio.run(run_all())
    with Client(server.address) as client:
        stats = client.stats()
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(prompt, 12)
    assert stats["spec_proposed_tokens"] > 0 and stats["spec_accepted_tokens"] <= stats["spec_proposed_tokens"]
