"""The server's maps (protocol/replies.py): every reply carries the protocol's version, a
delta's precomputed bytes are the packed map, and an error names its request when it can."""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.ipc.messages import SchedulerStats
from conveyor.protocol import limits, replies, wire


@settings(max_examples=200, deadline=None)
@given(
    rid=st.text(min_size=1, max_size=300),
    text=st.text(max_size=300),
    ids=st.lists(st.integers(0, 2**31 - 1), max_size=40),
    index=st.one_of(st.none(), st.integers(0, limits.MAX_N - 1)),
)
def test_delta_bytes_are_the_packed_map(rid, text, ids, index) -> None:
    """(Moved from tests/frontend/test_streaming.py with the encoder.) A sequence's delta
    (``index``, an n > 1 request) has the index between the id and the text."""
    text_bytes = msgpack.packb(text, use_bin_type=True)
    packed = replies.delta_head(rid, index) + text_bytes + replies.DELTA_IDS_KEY + msgpack.packb(ids)
    named = {} if index is None else {"index": index}
    assert packed == wire.pack({"type": wire.DELTA, "v": 1, "request_id": rid, **named, "text": text, "token_ids": ids})


def test_error_replies() -> None:
    unnamed = replies.error_reply(None, "malformed msgpack", wire.MALFORMED)
    version = wire.CLIENT_PROTOCOL_VERSION
    expected = {
        "type": wire.ERROR,
        "v": version,
        "request_id": None,
        "code": wire.MALFORMED,
        "message": "malformed msgpack",
    }
    assert unnamed == expected
    named = replies.error_map("r1", "already in flight", wire.DUPLICATE_REQUEST_ID)
    assert named == {**expected, "request_id": "r1", "code": wire.DUPLICATE_REQUEST_ID, "message": "already in flight"}
    final = replies.error_reply("r1", "prompt tokenizes to zero tokens", wire.INVALID_INPUT)
    assert (final["type"], final["v"], final["request_id"]) == (wire.FINAL, wire.CLIENT_PROTOCOL_VERSION, "r1")
    assert (final["text"], final["token_ids"], final["finish_reason"]) == ("", [], "error")
    assert final["error"] == "prompt tokenizes to zero tokens" and final["code"] == wire.INVALID_INPUT
    assert final["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    assert final["timing"] == {"queue_time": None, "ttft": None, "total": 0.0}


def test_final_counts_completion_tokens() -> None:
    timing = {"queue_time": 0.1, "ttft": 0.2, "total": 0.5}
    final = replies.final_reply("r", "ab", [5, 6], "length", None, prompt_tokens=3, cached_tokens=2, timing=timing)
    assert final["v"] == wire.CLIENT_PROTOCOL_VERSION and final["timing"] == timing
    assert final["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 2}
    assert final["code"] is None  # set only on an error final


def test_scheduler_errors_get_their_codes() -> None:
    assert replies.scheduler_error_code("overloaded: 8 requests are waiting") == wire.OVERLOADED
    assert replies.scheduler_error_code("timeout: not scheduled within max_queue_time (1 s)") == wire.TIMEOUT
    assert replies.scheduler_error_code("prompt + max_tokens = 900 tokens need 57 KV blocks") == wire.PROMPT_TOO_LONG
    assert replies.scheduler_error_code("worker process died") == wire.SERVER_ERROR
    assert replies.scheduler_error_code(None) == wire.SERVER_ERROR


def test_stats_reply_has_the_iteration_log_only_when_asked() -> None:
    stats = SchedulerStats(
        "q", 8, 5, 3, 1, 2, 10, 0, iteration_fields=["step", "batch_size"], recent_iterations=[[1, 2], [2, 3]]
    )
    summary = replies.stats_reply(stats, 4, iterations=False)
    assert (summary["type"], summary["v"], summary["in_flight"]) == (wire.STATS_REPLY, wire.CLIENT_PROTOCOL_VERSION, 4)
    blocks = (summary["total_blocks"], summary["free_blocks"], summary["held_blocks"], summary["num_waiting"])
    assert blocks == (8, 5, 3, 2)
    assert not {"iterations", "query_id", "iteration_fields", "recent_iterations"} & set(summary)
    full = replies.stats_reply(stats, 4, iterations=True)
    assert full["iterations"] == [{"step": 1, "batch_size": 2}, {"step": 2, "batch_size": 3}]
    assert {k: v for k, v in full.items() if k != "iterations"} == summary
