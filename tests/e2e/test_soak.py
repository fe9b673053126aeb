"""bin/soak against a live server with a KV cache small enough to force preemptions.

Random traffic (streams, chats, token ids, stop strings, priorities, seeded sampling, bad
input, requests given up on, ids reused as continuations, clients closing their connection
mid-request, stats and profile calls) for a few seconds; then the
server must have drained with no block held, and greedy and seeded requests replayed alone
must give the tokens they got under load, where they were chunked, preempted (swapped or
recomputed) and served from the prefix cache. The second soak adds the other kinds of
request (n > 1, best_of, logprobs, prompt_logprobs, constraints, tool calls, speculate: false)
under n-gram speculation.
"""

from __future__ import annotations

import asyncio

from conveyor_tools.cli import soak as soak_cli
from conveyor_tools.cli.soak import soak
from conveyor_tools.cli.soak_kinds import KIND_FIELDS, Mix

SERVE_ARGS = (
    "--num-kv-blocks", "72", "--block-size", "4", "--max-num-batched-tokens", "48", "--max-num-seqs", "8",
    "--policy", "priority", "--preemption", "auto", "--num-cpu-blocks", "40", "--max-model-len", "256",
    "--pipeline-steps", "on", "--threads", "1",
)  # fmt: skip


def test_soak_under_preemption_drains_and_replays(serve_factory, tiny_checkpoint, monkeypatch) -> None:
    server = serve_factory("--model", str(tiny_checkpoint), *SERVE_ARGS)
    monkeypatch.setattr(soak_cli, "PROGRESS_EVERY_S", 2.0)
    lines: list[str] = []
    report = asyncio.run(
        soak(server.address, duration=12, clients=10, seed=3, replay=25, timeout=60, mix=Mix(), progress=lines.append)
    )
    assert report.ok, "\n".join(report.failures)
    # It says where it is while it runs: ticks during the traffic, then each phase after it.
    assert [line for line in lines if "(traffic, " in line and " s left): " in line], lines
    assert "soak: draining the server" in lines and "soak: replaying up to 25 requests alone" in lines, lines
    stats = report.server
    # The traffic did reach the paths it is meant to cover.
    assert stats["num_preemptions_swap"] and stats["num_preemptions_recompute"], stats
    assert stats["prefix_cache_hit_tokens"] and stats["num_planned_ahead"], stats
    assert report.given_up and report.continued and report.vanished and report.probes, report
    assert report.finish_reasons.get("error"), report  # bad input and prompts too long: error finals
    assert report.replayed >= 10, report


def test_soak_of_every_kind_under_speculation(serve_factory, tiny_checkpoint) -> None:
    server = serve_factory(
        "--model", str(tiny_checkpoint), *SERVE_ARGS, "--speculative-method", "ngram", "--num-speculative-tokens", "3"
    )
    report = asyncio.run(soak(server.address, duration=12, clients=10, seed=5, replay=25, timeout=60))
    assert report.ok, "\n".join(report.failures)
    assert set(report.kinds) == KIND_FIELDS - {"lora"}, report.kinds  # (the server serves no adapter)
    stats = report.server
    assert stats["spec_num_proposals"] and stats["num_preemptions_swap"] and stats["num_preemptions_recompute"], stats
    assert report.replayed >= 10, report
