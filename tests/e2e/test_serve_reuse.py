"""bin/serve end to end: prefix reuse across requests and continuation of a finished request.

The second request with the same system prompt reports the reused tokens in
``usage.cached_tokens``; a continuation (same request id, more input) costs only its new
tokens, returns only its new output, and equals HF greedy on the whole conversation. An id
reused the moment its request was aborted gets its own whole output, untouched by what the
scheduler still sent about the aborted one.
"""

from __future__ import annotations

import time

from conveyor.client import Client

SERVE_ARGS = ("--num-kv-blocks", "96", "--block-size", "8", "--threads", "1", "--policy", "priority")
SYSTEM = [(13 * i) % 200 + 10 for i in range(16)]  # two full blocks of 8


def test_prefix_reuse_and_continuation(serve_factory, tiny_checkpoint, hf_greedy) -> None:
    from conveyor.frontend.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_checkpoint)
    server = serve_factory("--model", str(tiny_checkpoint), *SERVE_ARGS)
    greedy = dict(temperature=0, ignore_eos=True)
    with Client(server.address, timeout=60) as client:
        first_prompt = SYSTEM + [3, 4, 5]
        first = client.generate(token_ids=first_prompt, max_tokens=6, request_id="conv", priority=2, **greedy)
        assert first.finish_reason == "length" and first.usage.cached_tokens == 0
        assert first.token_ids == hf_greedy(first_prompt, 6)

        other = client.generate(token_ids=SYSTEM + [7, 8], max_tokens=3, **greedy)
        assert other.usage.cached_tokens == len(SYSTEM)  # the shared system prompt was not recomputed
        assert other.token_ids == hf_greedy(SYSTEM + [7, 8], 3)

        # The next turn of "conv": only the new input is sent; the server remembers the rest.
        context = first_prompt + first.token_ids
        second = client.generate(token_ids=[9, 10, 11], max_tokens=5, request_id="conv", **greedy)
        assert second.finish_reason == "length"
        assert second.usage.prompt_tokens == len(context) + 3
        assert second.usage.cached_tokens == len(context) - 1  # the last output token and the new input run
        assert second.token_ids == hf_greedy(context + [9, 10, 11], 5)
        assert (
            second.text
            == tok.decode(context + [9, 10, 11] + second.token_ids)[len(tok.decode(context + [9, 10, 11])) :]
        )

        # A third turn streams just as well.
        context += [9, 10, 11] + second.token_ids
        deltas = list(client.stream(token_ids=[12], max_tokens=3, request_id="conv", **greedy))
        third = deltas[-1].result
        assert third.usage.cached_tokens == len(context) - 1
        assert sum((d.token_ids for d in deltas), []) == third.token_ids == hf_greedy(context + [12], 3)

        stats = client.stats(iterations=True)
        assert stats["prefix_cache_hit_tokens"] >= len(SYSTEM) + 2 * (len(context) - 1) - len(second.token_ids) - 3
        assert stats["free_blocks"] + stats["cached_blocks"] + stats["held_blocks"] == stats["total_blocks"]
        assert stats["cached_blocks"] > 0 and stats["held_blocks"] == 0
        rows = stats["iterations"]
        assert rows and {"batch_size", "prefill_tokens", "decode_tokens", "prefix_hit_tokens"} <= set(rows[-1])
        assert sum(r["prefix_hit_tokens"] for r in rows) == stats["prefix_cache_hit_tokens"]

        bad = client.generate(token_ids=[1, 2], max_tokens=1, priority="high")
        assert bad.finish_reason == "error" and "priority" in bad.error


def test_an_id_reused_right_after_its_abort_gets_its_own_output(serve_factory, tiny_checkpoint, hf_greedy) -> None:
    """Abort a running stream and at once send a request with its id (a continuation of the
    aborted turn). The scheduler reads the abort after the stream's last steps and answers it
    with an ``abort`` output; none of that may reach the new request, which must finish with
    its own tokens, as HF greedy on the whole context has them."""
    server = serve_factory("--model", str(tiny_checkpoint), *SERVE_ARGS)
    head = {"type": "generate", "v": 1, "temperature": 0, "ignore_eos": True}
    old_prompt = list(range(10, 40))
    with Client(server.address, timeout=60) as client:
        for round_ in range(3):
            rid = f"again-{round_}"
            client._send({**head, "request_id": rid, "token_ids": old_prompt, "max_tokens": 150, "stream": True})
            assert client._next(rid)["type"] == "delta"  # running at the scheduler
            client.abort(rid)
            new_input = [9, 10, 11 + round_]
            client._send({**head, "request_id": rid, "token_ids": new_input, "max_tokens": 5})
            while (msg := client._next(rid))["type"] != "final":
                assert msg["type"] == "delta"
            assert msg["finish_reason"] == "abort"
            aborted_ids = msg["token_ids"]
            assert aborted_ids == hf_greedy(old_prompt, len(aborted_ids))
            new = client._next(rid)  # not streamed: its final is all it gets
            assert new["type"] == "final", new
            assert new["finish_reason"] == "length" and new["error"] is None, new
            context = old_prompt + aborted_ids + new_input
            assert new["usage"]["prompt_tokens"] == len(context)
            assert new["token_ids"] == hf_greedy(context, 5)
        deadline = time.monotonic() + 5
        while (stats := client.stats())["held_blocks"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats["held_blocks"] == 0 and stats["in_flight"] == 0 and stats["num_running"] == 0
