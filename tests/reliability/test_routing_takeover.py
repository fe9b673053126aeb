"""docs/reliability.md, "Faults": a second connection under a connected routing id, on a
running bin/serve. The new connection is served at once. The old connection is not told:
its pending request stays running at the server (not aborted), its replies go to the
identity's new connection (which drops them as unknown), and the old client learns nothing
until its own ``timeout`` raises TimeoutError. (tests/reliability/test_cross_client.py
checks the frontend's side, where a disconnect of the old connection aborts only its own
requests, against a stand-in scheduler.)"""

from __future__ import annotations

import time

import pytest

from conveyor.client import Client
from tests.e2e.serve_harness import ABORT_BOUND_S, LONG_MAX_TOKENS, LONG_SERVE_ARGS, finished_counts, long_context_copy

IDENTITY = b"takeover-test-identity"
OLD_TIMEOUT_S = 3.0


def test_a_new_connection_under_a_routing_id_takes_it_over(serve_factory, tiny_checkpoint, tmp_path) -> None:
    server = serve_factory("--model", str(long_context_copy(tiny_checkpoint, tmp_path)), *LONG_SERVE_ARGS)
    with Client(server.address) as watcher:
        old = Client(server.address, identity=IDENTITY, timeout=OLD_TIMEOUT_S)
        stream = old.stream(token_ids=[9] * 20, max_tokens=LONG_MAX_TOKENS, ignore_eos=True, temperature=0)
        next(stream)  # the old connection's request is streaming
        before = finished_counts(watcher)
        with Client(server.address, identity=IDENTITY, timeout=60) as new:
            took_over = time.monotonic()
            result = new.generate(token_ids=[5] * 8, max_tokens=4, ignore_eos=True, temperature=0)
            served = time.monotonic() - took_over
            assert result.finish_reason == "length" and len(result.token_ids) == 4, result
            assert served < ABORT_BOUND_S, served
            with pytest.raises(TimeoutError):  # no more replies, no ServerGoneError: only its own timeout
                for _ in stream:
                    pass
            silent = time.monotonic() - took_over
            stats = watcher.stats()
            after = finished_counts(watcher)
            old.close()
    assert silent >= OLD_TIMEOUT_S - 0.5, silent
    # the old request was not aborted by the takeover: still running, no abort counted
    assert stats["held_blocks"] > 0 and stats["in_flight"] >= 1, stats
    assert after["abort"] == before["abort"] and after["length"] == before["length"] + 1, (before, after)
