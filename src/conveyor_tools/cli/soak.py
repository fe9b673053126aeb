"""bin/soak: random client traffic against a running server, then proof that nothing was lost.

    bin/soak --port 7700 --duration 120 --clients 24     # against bin/serve on port 7700

``--clients`` concurrent clients each send requests back to back for ``--duration`` seconds,
every one drawn at random (seeded by ``--seed``): a text prompt (half of them after a shared
system prompt, so admissions hit the prefix cache), a chat, raw token ids or a prompt too
long for the model; streamed or not; greedy, or sampled with a seed, top-k, top-p; stop
strings, ``ignore_eos``, priorities; an invalid field now and then. One request in five is
given up on (a stream left after a few deltas, a ``generate`` cancelled after a random
wait), and one in five reuses the id of one of the client's finished or given-up requests,
i.e. continues that conversation. Now and then a client sends a request on a connection of
its own and closes it mid-request, or asks for the stats and the latency profile. Run it against a server with a small KV cache
(``--num-kv-blocks``) and token budget to force chunked prefills and preemptions.

What is checked (each failure is listed, and the exit status is 1):

- every request ends exactly once with a final (an error final for bad input), within
  ``--timeout``, and no client call raises; an id reused after its request ended or was
  given up on is never refused as still in flight;
- no result has more tokens than its ``max_tokens``, and no stop string shows in its text;
- afterwards the server drains: nothing running, waiting or in flight, no KV block held or
  swapped out, every GPU block free or cached;
- a stream's deltas add up to its final (text and token ids);
- ``--replay`` of the greedy and seeded requests that were neither continuations nor given
  up on (streamed or not) are sent again, unstreamed, one at a time on the idle server and
  must produce the same token ids, finish reason and text as under load (where they were
  chunked, preempted, swapped, recomputed or served from the prefix cache).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from conveyor.client import AsyncClient, CompletionResult, generate_message
from conveyor.protocol import wire
from conveyor.cli.server_address import add_address_arguments, server_address
from conveyor.runtime.config import replica_process_name

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did"
).split()
SYSTEM_PROMPT = " ".join(WORDS[:60])
STOP_STRINGS = ("e", " a", "th", "xyz", ".")


@dataclass
class Report:
    """What a soak saw; ``failures`` empty means every check passed."""

    requests: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    given_up: int = 0
    vanished: int = 0  # requests whose client closed its connection mid-request
    probes: int = 0  # stats + profile calls made under load
    continued: int = 0
    streamed: int = 0
    replayed: int = 0
    failures: list[str] = field(default_factory=list)
    server: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, what: str) -> None:
        if len(self.failures) < 50:  # enough to see the pattern
            self.failures.append(what)


@dataclass
class _Drawn:
    """One request's inputs, as drawn."""

    prompt: str | None
    messages: list[dict[str, str]] | None
    token_ids: list[int] | None
    fields: dict[str, Any]

    def kwargs(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "messages": self.messages, "token_ids": self.token_ids, **self.fields}


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def draw(rng: random.Random) -> _Drawn:
    fields: dict[str, Any] = {"max_tokens": rng.randint(1, 48), "temperature": 0}
    if rng.random() < 0.3:
        fields.update(temperature=0.9, seed=rng.randrange(1000))
        if rng.random() < 0.5:
            fields["top_k"] = rng.randint(1, 50)
        if rng.random() < 0.5:
            fields["top_p"] = rng.uniform(0.3, 1.0)
    if rng.random() < 0.3:
        fields["stop"] = [rng.choice(STOP_STRINGS)]
    if rng.random() < 0.3:
        fields["priority"] = rng.randint(-5, 5)
    if rng.random() < 0.3:
        fields["ignore_eos"] = True
    if rng.random() < 0.03:
        fields["max_tokens"] = -1  # invalid: must come back as an error final
    kind = rng.random()
    if kind < 0.15:
        user = _words(rng, rng.randint(1, 30))
        return _Drawn(None, [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}], None, fields)
    if kind < 0.25:
        return _Drawn(None, None, [rng.randint(3, 500) for _ in range(rng.randint(1, 60))], fields)
    if kind < 0.3:
        return _Drawn(_words(rng, rng.randint(200, 400)), None, None, fields)  # long: chunked, or too long
    prefix = SYSTEM_PROMPT + " " if rng.random() < 0.5 else ""
    return _Drawn(prefix + _words(rng, rng.randint(1, 40)), None, None, fields)


class _Soak:
    def __init__(self, address: str, timeout: float) -> None:
        self.address = address
        self.timeout = timeout
        self.report = Report()
        self.replayable: list[tuple[_Drawn, CompletionResult]] = []
        self.run_id = uuid.uuid4().hex[:8]  # request ids of their own, whatever else the server serves

    def _check_result(self, drawn: _Drawn, result: CompletionResult, text: str) -> None:
        report = self.report
        report.finish_reasons[result.finish_reason] = report.finish_reasons.get(result.finish_reason, 0) + 1
        if result.finish_reason == "abort":  # only what it gave up on is aborted, and that it no longer reads
            report.fail(f"{result.request_id}: ended by an abort nobody sent it")
        if result.finish_reason == "error":
            if "in flight" in (result.error or ""):  # ids are reused only once their request ended or was given up
                report.fail(f"{result.request_id}: {result.error}")
            return
        max_tokens = drawn.fields["max_tokens"]
        if len(result.token_ids) > max_tokens:
            report.fail(f"{result.request_id}: {len(result.token_ids)} tokens for max_tokens={max_tokens}")
        for stop in drawn.fields.get("stop", ()):
            if stop in text:
                report.fail(f"{result.request_id}: stop string {stop!r} in its text {text[:80]!r}")

    async def vanish(self, rng: random.Random, drawn: _Drawn, request_id: str) -> None:
        """A client that sends a streamed request, reads a reply or two and closes its connection
        without a word: the server must abort the request and free its blocks on its own."""
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        try:
            msg = generate_message(drawn.prompt, drawn.messages, drawn.token_ids, request_id, True, drawn.fields)
            await sock.send(wire.pack(msg))
            for _ in range(rng.randint(0, 2)):
                if not await sock.poll(self.timeout * 1000):
                    self.report.fail(f"{request_id}: no reply within {self.timeout} s")
                    break
                if wire.unpack_map(await sock.recv())["type"] == wire.FINAL:
                    break  # nothing follows a final
        finally:
            sock.close(linger=0)
        self.report.vanished += 1

    async def probe(self, client: AsyncClient) -> None:
        """Stats and the latency profile, asked for under load."""
        stats = await client.stats()
        if stats["free_blocks"] + stats["cached_blocks"] + stats["held_blocks"] != stats["total_blocks"]:
            self.report.fail(f"block counts do not add up under load: {stats}")
        processes = (await client.profile(5.0))["processes"]
        replicas = len(stats["replicas"])  # data-parallel replica i's processes are scheduler.i, worker.i
        expected = ["frontend"] + [replica_process_name(p, i) for i in range(replicas) for p in ("scheduler", "worker")]
        if [p["process"] for p in processes] != expected:
            self.report.fail(f"profile names {[p['process'] for p in processes]}, expected {expected}")
        self.report.probes += 1

    async def one(self, client: AsyncClient, rng: random.Random, ids: list[str], prefix: str) -> None:
        report = self.report
        drawn = draw(rng)
        action = rng.random()
        if action < 0.05:
            try:
                if action < 0.03:
                    await self.vanish(rng, drawn, f"{prefix}{report.requests}-gone")
                else:
                    await self.probe(client)
            except Exception as exc:  # noqa: BLE001
                report.fail(f"{'vanishing client' if action < 0.03 else 'probe'} raised {exc!r:.200}")
            return
        continued = bool(ids) and rng.random() < 0.2
        request_id = rng.choice(ids) if continued else f"{prefix}{report.requests}"
        give_up = rng.random() < 0.2
        report.requests += 1
        report.continued += continued
        try:
            if rng.random() < 0.5:
                final = await self._streamed(client, rng, drawn, request_id, give_up)
            else:
                final = await self._unstreamed(client, rng, drawn, request_id, give_up)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, none stops the soak
            report.fail(f"client call raised {exc!r:.200}")
            return
        finally:
            del ids[:-63]  # a client remembers its recent ids only
        ids.append(request_id)
        if final is None:
            report.given_up += 1
        elif not continued and final.finish_reason != "error":
            self.replayable.append((drawn, final))

    async def _streamed(
        self, client: AsyncClient, rng: random.Random, drawn: _Drawn, request_id: str, give_up: bool
    ) -> CompletionResult | None:
        """The request as a stream, checked; None if given up (left after a few deltas)."""
        self.report.streamed += 1
        text, tokens, final, seen, limit = [], [], None, 0, rng.randint(0, 5)
        stream = client.stream(request_id=request_id, **drawn.kwargs())
        async for delta in stream:  # (run to its end after the final: that ends the request on the client)
            seen += 1
            text.append(delta.text)
            tokens += delta.token_ids
            if delta.result is not None:
                final = delta.result
            elif give_up and seen > limit:
                await stream.aclose()
                return None
        if final is None:
            raise AssertionError(f"{request_id}: the stream ended without a final")
        self._check_result(drawn, final, "".join(text))
        if final.finish_reason != "error" and ("".join(text) != final.text or tokens != final.token_ids):
            self.report.fail(f"{request_id}: its deltas ({tokens}) do not add up to its final ({final.token_ids})")
        return final

    async def _unstreamed(
        self, client: AsyncClient, rng: random.Random, drawn: _Drawn, request_id: str, give_up: bool
    ) -> CompletionResult | None:
        """The request unstreamed, checked; None if given up (cancelled after a random wait)."""
        pending = client.generate(request_id=request_id, **drawn.kwargs())
        try:
            result = await asyncio.wait_for(pending, rng.uniform(0, 0.3) if give_up else None)
        except asyncio.TimeoutError:
            if not give_up:
                raise  # the client's own timeout: a hung request
            return None  # cancelled: the client aborts it
        self._check_result(drawn, result, result.text)
        return result

    async def client_loop(self, index: int, seed: int, deadline: float) -> None:
        rng = random.Random(seed * 1_000_003 + index)
        ids: list[str] = []
        async with AsyncClient(self.address, timeout=self.timeout) as client:
            while time.monotonic() < deadline:
                await self.one(client, rng, ids, f"soak-{self.run_id}-{index}-")

    async def drain(self, client: AsyncClient) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            stats = await client.stats()
            if not (stats["num_running"] or stats["num_waiting"] or stats["in_flight"]) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        self.report.server = stats
        for key in ("num_running", "num_waiting", "in_flight", "held_blocks", "swapped_blocks", "num_swapped"):
            if stats[key]:
                self.report.fail(f"server not drained: {key} = {stats[key]}")
        if stats["free_blocks"] + stats["cached_blocks"] != stats["total_blocks"]:
            self.report.fail(f"GPU blocks: {stats['free_blocks']} free + {stats['cached_blocks']} cached != {stats['total_blocks']}")

    async def replay(self, client: AsyncClient, rng: random.Random, n: int) -> None:
        for drawn, under_load in rng.sample(self.replayable, min(n, len(self.replayable))):
            alone = await client.generate(**drawn.kwargs())
            self.report.replayed += 1
            same = (alone.token_ids, alone.finish_reason, alone.text) == (
                under_load.token_ids, under_load.finish_reason, under_load.text
            )
            if not same:
                self.report.fail(
                    f"replay of {under_load.request_id} ({drawn.fields}) differs: under load {under_load.token_ids} "
                    f"({under_load.finish_reason}), alone {alone.token_ids} ({alone.finish_reason})"
                )


async def soak(
    address: str, *, duration: float, clients: int, seed: int = 0, replay: int = 50, timeout: float = 120.0
) -> Report:
    """Run the soak of the module docstring against ``address``; the report lists every failed check."""
    run = _Soak(address, timeout)
    deadline = time.monotonic() + duration
    await asyncio.gather(*(run.client_loop(i, seed, deadline) for i in range(clients)))
    async with AsyncClient(address, timeout=timeout) as client:
        await run.drain(client)
        await run.replay(client, random.Random(seed), replay)
    return run.report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_address_arguments(p)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replay", type=int, default=50, help="greedy/seeded requests to replay alone afterwards")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a request may take before it counts as hung")
    args = p.parse_args(argv)
    report = asyncio.run(
        soak(
            server_address(args),
            duration=args.duration,
            clients=args.clients,
            seed=args.seed,
            replay=args.replay,
            timeout=args.timeout,
        )
    )
    summary = {k: v for k, v in vars(report).items() if k != "failures"}
    print(json.dumps(summary, indent=1))
    for failure in report.failures:
        print(f"FAILED: {failure}")
    print("soak: OK" if report.ok else f"soak: {len(report.failures)} failure(s)")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
