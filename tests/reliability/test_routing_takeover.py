"""docs/reliability.md, "Faults": a second connection under a connected routing id, on a
running bin/serve. The new connection takes the routing id over (ROUTER_HANDOVER) and is
served at once. The old connection can receive nothing more (every reply under the routing id
goes to the new one), so the server aborts the requests it sent as soon as the new
connection's first message shows the takeover: counted ``abort``, KV blocks free within
ABORT_BOUND_S. The old client is not told (libzmq keeps its connection open and answers its
heartbeats): it learns from its own ``timeout`` (TimeoutError, not ServerGoneError).
(tests/reliability/test_cross_client.py checks the same on the frontend alone, with every
ordering forced, against a stand-in scheduler.)"""

from __future__ import annotations

import time

import pytest

from conveyor.client import Client
from tests.e2e.serve_harness import (
    ABORT_BOUND_S,
    LONG_MAX_TOKENS,
    LONG_SERVE_ARGS,
    finished_counts,
    long_context_copy,
    wait_until_freed,
)

IDENTITY = b"takeover-test-identity"
OLD_TIMEOUT_S = 2.0


def test_a_new_connection_under_a_routing_id_takes_it_over(serve_factory, tiny_checkpoint, tmp_path) -> None:
    server = serve_factory("--model", str(long_context_copy(tiny_checkpoint, tmp_path)), *LONG_SERVE_ARGS)
    with Client(server.address) as watcher:
        old = Client(server.address, identity=IDENTITY, timeout=OLD_TIMEOUT_S)
        stream = old.stream(token_ids=[9] * 20, max_tokens=LONG_MAX_TOKENS, ignore_eos=True, temperature=0)
        next(stream)  # the old connection's request is streaming (it would run ~16 s)
        before = finished_counts(watcher)
        with Client(server.address, identity=IDENTITY, timeout=60) as new:
            took_over = time.monotonic()
            result = new.generate(token_ids=[5] * 8, max_tokens=4, ignore_eos=True, temperature=0)
            served = time.monotonic() - took_over
            assert result.finish_reason == "length" and len(result.token_ids) == 4, result
            assert served < ABORT_BOUND_S, served
            wait_until_freed(
                watcher, took_over, "the takeover"
            )  # the old connection's request: aborted, its blocks free
            after = finished_counts(watcher)
            assert after["abort"] == before["abort"] + 1, (before, after)
            assert after["length"] == before["length"] + 1, (before, after)  # the new connection's request only
            with pytest.raises(TimeoutError):  # no more replies, no ServerGoneError: only its own timeout
                for _ in stream:
                    pass
            silent = time.monotonic() - took_over
            old.close()
    assert silent >= OLD_TIMEOUT_S - 0.5, silent
