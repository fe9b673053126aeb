"""bin/bench reads the server profile over exactly its run, also when the query is late."""

from __future__ import annotations

import asyncio
import time

from conveyor_tools.bench.drivers import profile_of_run


class LateServer:
    """Answers a profile query as a server would whose processes take the query ``delay_s``
    after it was sent (a loaded machine): each window ends at that later moment."""

    def __init__(self, delay_s: float) -> None:
        self.delay_ns = int(delay_s * 1e9)
        self.windows: list[float] = []

    async def profile(self, window_s: float, series: list[str] | None = None) -> dict:
        self.windows.append(window_s)
        now = time.monotonic_ns() + self.delay_ns
        return {"processes": [{"process": p, "now_ns": now, "window_s": window_s} for p in ("scheduler", "worker")]}


def _covers(reply: dict, start_ns: int) -> bool:
    return all(p["now_ns"] - p["window_s"] * 1e9 <= start_ns for p in reply["processes"])


def test_a_late_query_is_widened_until_its_window_holds_the_run() -> None:
    start = time.monotonic_ns() - 100_000_000  # a 0.1 s run just ended
    server = LateServer(delay_s=0.5)
    reply = asyncio.run(profile_of_run(server, start))
    assert _covers(reply, start)
    assert len(server.windows) == 2 and server.windows[0] < 0.5 < server.windows[1]


def test_a_prompt_query_asks_once_for_the_run_and_little_more() -> None:
    start = time.monotonic_ns() - 2_000_000_000
    server = LateServer(delay_s=0.0)
    reply = asyncio.run(profile_of_run(server, start))
    assert _covers(reply, start) and len(server.windows) == 1
    assert 2.0 <= server.windows[0] < 2.5  # the run and the query's slack, not the quiet before it
