"""The 8-bit KV cache through ``conveyor.Engine(kv_cache_dtype=...)``: everything that moves,
shares or rebuilds KV keeps working on it. Greedy tokens under pressure (chunked prefills,
swap and recompute preemption, the prefix cache, speculative decoding with a draft model,
whose own cache is 8-bit too) and over
two tensor-parallel ranks equal those of the same 8-bit cache served without any of that:
block moves copy 8-bit blocks exactly and the scales are per layer (the same on every rank),
so none of it may change a token. No block is left held."""

from __future__ import annotations

import pytest

from tests.engine.conftest import GREEDY, run_all

PRESSED = dict(max_batch_size=4, max_batch_tokens=14, num_kv_blocks=16, num_cpu_blocks=64)
# The target as its own draft: it proposes on every decode (verified over the 8-bit cache; an
# n-gram proposal goes through the same verify step, but these outputs hardly repeat).
DRAFT = dict(speculative_method="draft", num_speculative_tokens=3)


def prompt(i: int) -> list[int]:
    return [(11 * i + 7 * j) % 4000 + 5 for j in range(9 + 3 * i)]


PROMPTS = {f"r{i}": prompt(i) for i in range(5)} | {"again": prompt(4)}  # (a prefix-cache hit on r4's)


def _serve(engine, max_tokens: int = 20) -> dict[str, list[int]]:
    requests = {
        rid: engine.add_request(token_ids=p, request_id=rid, max_tokens=max_tokens, **GREEDY)
        for rid, p in PROMPTS.items()
    }
    run_all(engine)
    assert all(r.finish_reason == "length" for r in requests.values())
    assert engine.stats()["held_blocks"] == 0
    return {rid: r.tokens for rid, r in requests.items()}


@pytest.fixture(scope="module")
def roomy(tiny_checkpoint):
    """``roomy(kv_cache_dtype)``: the tokens of that cache served one request at a time with room
    to spare (each dtype's computed once)."""
    from conveyor import Engine

    served: dict[str, dict[str, list[int]]] = {}

    def tokens(kv: str) -> dict[str, list[int]]:
        if kv not in served:
            engine = Engine(
                tiny_checkpoint, block_size=4, num_kv_blocks=256, threads=2, device="cpu", kv_cache_dtype=kv
            )
            served[kv] = {}
            for rid, p in PROMPTS.items():
                one = engine.add_request(token_ids=p, max_tokens=20, **GREEDY)
                run_all(engine)
                served[kv][rid] = one.tokens
        return served[kv]

    return tokens


@pytest.mark.parametrize(
    ("kv", "pressure"),
    [
        ("fp8", dict(preemption="swap")),
        ("int8", dict(preemption="swap")),
        ("fp8", dict(preemption="recompute", **DRAFT)),
        ("int8", dict(preemption="swap", **DRAFT)),
    ],
    ids=["fp8-swap", "int8-swap", "fp8-recompute-draft", "int8-swap-draft"],
)
def test_pressure_changes_no_token(tiny_engine, tiny_checkpoint, roomy, kv, pressure):
    if "speculative_method" in pressure:
        pressure = {**pressure, "speculative_model": str(tiny_checkpoint)}
    engine = tiny_engine(**{**PRESSED, **pressure}, kv_cache_dtype=kv)
    assert engine.runner.kv_caches[0].element_size() == 1
    got = _serve(engine)
    stats = engine.stats()
    assert got == roomy(kv)
    assert stats[f"num_preemptions_{pressure['preemption']}"] > 0, "the run was to preempt"
    assert stats["prefix_cache_hit_tokens"] > 0
    if "speculative_method" in pressure:
        assert stats["spec_accepted_tokens"] > 0


def test_two_tensor_parallel_ranks_store_what_one_does(tiny_checkpoint, roomy):
    from conveyor import Engine

    engine = Engine(
        tiny_checkpoint, block_size=4, num_kv_blocks=256, threads=1, device="cpu", kv_cache_dtype="fp8",
        tensor_parallel_size=2, distributed_timeout_s=30,
    )  # fmt: skip
    try:
        assert _serve(engine) == roomy("fp8")
    finally:
        engine.close()
