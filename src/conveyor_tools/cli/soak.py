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
its own and closes it mid-request, or asks for the stats and the latency profile. Run it against a
server with a small KV cache (``--num-kv-blocks``) and token budget to force chunked prefills and
preemptions.

Unless ``--plain``, requests also take the kinds of soak_kinds.py now and then: ``n`` in
{2, 3} (and ``best_of``), ``logprobs`` / ``prompt_logprobs``, a JSON-schema, regex or choice
``constraint`` (``tools`` with ``tool_choice: required`` for chats), ``speculate: false``,
and ``lora`` naming one of the adapters the server's stats list. ``--lora-reload NAME=DIR``
also loads and unloads an adapter under load (with each probe; bin/serve
--enable-lora-loading), which requests then name too.

What is checked (each failure is listed, and the exit status is 1):

- every request ends exactly once with a final (an error final for bad input), within
  ``--timeout``, and no client call raises; an id reused after its request ended or was
  given up on is never refused as still in flight;
- every choice of a final (one for ``n`` = 1) is checked as soak_kinds.py says: no more
  tokens than ``max_tokens``, no stop string in its text, valid under its constraint when it
  ended with ``stop``, one log-probability row per token; greedy choices agree;
- afterwards the server drains: nothing running, waiting or in flight, no KV block held or
  swapped out, every GPU block free or cached;
- a stream's deltas add up to its final, per choice (text, token ids, logprob rows);
- ``--replay`` of the greedy and seeded requests that were neither continuations nor given
  up on (streamed or not) are sent again, unstreamed, one at a time on the idle server and
  must produce the same token ids, finish reason and text as under load, per choice (where
  they were chunked, preempted, swapped, recomputed or served from the prefix cache), and
  log-probabilities within ``LOGPROB_TOLERANCE``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import re
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from conveyor.cli.server_address import add_address_arguments, server_address
from conveyor.client import AsyncClient, CompletionResult, ServerError, generate_message
from conveyor.protocol import wire
from conveyor.runtime.config import replica_process_name
from conveyor_tools.cli.soak_kinds import (
    KIND_FIELDS,
    LOGPROB_TOLERANCE,
    Mix,
    add_kinds,
    check_choices,
    logprobs_drift,
    outcome,
    unstreamable,
)

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did"
).split()
SYSTEM_PROMPT = " ".join(WORDS[:60])
STOP_STRINGS = ("e", " a", "th", "xyz", ".")


RARE_ACTIONS = (0.0, 0.04)  # a vanishing client, then a probe (Soak.one's action thresholds)


@dataclass
class Report:
    """What a soak saw; ``failures`` empty means every check passed."""

    requests: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    given_up: int = 0
    vanished: int = 0  # requests whose client closed its connection mid-request
    probes: int = 0  # stats + profile calls made under load
    lora_updates: int = 0  # --lora-reload loads and unloads done under load
    continued: int = 0
    streamed: int = 0
    replayed: int = 0
    kinds: dict[str, int] = field(default_factory=dict)  # requests drawn with each field of soak_kinds
    errors: dict[str, int] = field(default_factory=dict)  # error finals by their message's start
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


def draw(rng: random.Random, mix: Mix = Mix()) -> _Drawn:
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
    add_kinds(rng, mix, fields, chat=kind < 0.15)
    if kind < 0.15:
        user = _words(rng, rng.randint(1, 30))
        return _Drawn(
            None, [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}], None, fields
        )
    if kind < 0.25:
        return _Drawn(None, None, [rng.randint(3, 500) for _ in range(rng.randint(1, 60))], fields)
    if kind < 0.3:
        return _Drawn(_words(rng, rng.randint(200, 400)), None, None, fields)  # long: chunked, or too long
    prefix = SYSTEM_PROMPT + " " if rng.random() < 0.5 else ""
    return _Drawn(prefix + _words(rng, rng.randint(1, 40)), None, None, fields)


class _Soak:
    def __init__(self, address: str, timeout: float, mix: Mix, reload: tuple[str, str] | None) -> None:
        self.address = address
        self.timeout = timeout
        self.mix = mix
        self.reload = reload  # (name, directory) of the adapter loaded and unloaded under load
        self.reloaded = False  # whether it is loaded now
        self.reload_lock = asyncio.Lock()
        self.report = Report()
        self.replayable: list[tuple[_Drawn, CompletionResult]] = []
        self.run_id = uuid.uuid4().hex[:8]  # request ids of their own, whatever else the server serves

    def _check_result(self, drawn: _Drawn, result: CompletionResult) -> None:
        report = self.report
        report.finish_reasons[result.finish_reason] = report.finish_reasons.get(result.finish_reason, 0) + 1
        if result.finish_reason == "abort":  # only what it gave up on is aborted, and that it no longer reads
            report.fail(f"{result.request_id}: ended by an abort nobody sent it")
        if result.finish_reason == "error":
            reason = re.sub(r"\d+", "N", (result.error or "").split(":")[0])[:60]
            report.errors[reason] = report.errors.get(reason, 0) + 1
            if "in flight" in (result.error or ""):  # ids are reused only once their request ended or was given up
                report.fail(f"{result.request_id}: {result.error}")
            return
        for failure in check_choices(drawn.fields, result, raw_prompt=drawn.token_ids is not None):
            report.fail(f"{result.request_id} ({drawn.fields}): {failure}")

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
        if self.reload:
            await self.toggle_lora(client, load=not self.reloaded)

    async def toggle_lora(self, client: AsyncClient, load: bool) -> None:
        """Load (or unload) the ``--lora-reload`` adapter that requests name now and then
        (those sent while it is unloaded end in errors); an unload is refused only while a
        request runs or waits under it."""
        name, path = self.reload
        async with self.reload_lock:
            if load == self.reloaded:
                return
            try:
                await (client.load_lora(name, path) if load else client.unload_lora(name))
            except ServerError as exc:
                if exc.code != "lora_in_use":
                    raise
                return
            self.reloaded = load
            self.report.lora_updates += 1

    async def one(
        self, client: AsyncClient, rng: random.Random, ids: list[str], prefix: str, action: float | None = None
    ) -> None:
        """One drawn action: under 0.03 a vanishing client, under 0.05 a probe, else a request."""
        report = self.report
        drawn = draw(rng, self.mix)
        action = rng.random() if action is None else action
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
        for key in KIND_FIELDS & drawn.fields.keys():
            report.kinds[key] = report.kinds.get(key, 0) + 1
        try:
            if rng.random() < 0.5 and not unstreamable(drawn.fields):
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
        final, seen, limit = None, 0, rng.randint(0, 5)
        texts: dict[int, str] = {}  # per sequence (index), what its deltas added up to
        tokens: dict[int, list[int]] = {}
        rows: dict[int, int] = {}  # logprob rows its deltas carried
        stream = client.stream(request_id=request_id, **drawn.kwargs())
        async for delta in stream:  # (run to its end after the final: that ends the request on the client)
            seen += 1
            texts[delta.index] = texts.get(delta.index, "") + delta.text
            tokens[delta.index] = tokens.get(delta.index, []) + delta.token_ids
            rows[delta.index] = rows.get(delta.index, 0) + len((delta.logprobs or {}).get("token_logprobs", ()))
            if delta.result is not None:
                final = delta.result
            elif give_up and seen > limit:
                await stream.aclose()
                return None
        if final is None:
            raise AssertionError(f"{request_id}: the stream ended without a final")
        self._check_result(drawn, final)
        if final.finish_reason == "error":
            return final
        for choice in final.choices:
            name = f"{request_id}: choice {choice.index}'s deltas"
            added = (texts.get(choice.index, ""), tokens.get(choice.index, []))
            if added != (choice.text, choice.token_ids):
                self.report.fail(f"{name} ({added[1]}) do not add up to its final ({choice.token_ids})")
            if "logprobs" in drawn.fields and rows.get(choice.index, 0) != len(choice.token_ids):
                self.report.fail(
                    f"{name} carried {rows.get(choice.index, 0)} logprob rows for {len(choice.token_ids)} tokens"
                )
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
        self._check_result(drawn, result)
        return result

    async def client_loop(self, index: int, seed: int, deadline: float) -> None:
        rng = random.Random(seed * 1_000_003 + index)
        ids: list[str] = []
        prefix = f"soak-{self.run_id}-{index}-"
        async with AsyncClient(self.address, timeout=self.timeout) as client:
            # The rare paths come by chance (5 % of actions); the first client also takes each
            # once at its start, so a soak that a busy machine slows to a few dozen actions
            # still covers them.
            for action in RARE_ACTIONS if index == 0 else ():
                await self.one(client, rng, ids, prefix, action)
            while time.monotonic() < deadline:
                await self.one(client, rng, ids, prefix)

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
            self.report.fail(
                f"GPU blocks: {stats['free_blocks']} free + {stats['cached_blocks']} cached != {stats['total_blocks']}"
            )

    async def replay(self, client: AsyncClient, rng: random.Random, n: int) -> None:
        for drawn, under_load in rng.sample(self.replayable, min(n, len(self.replayable))):
            alone = await client.generate(**drawn.kwargs())
            self.report.replayed += 1
            if outcome(alone) != outcome(under_load):
                self.report.fail(
                    f"replay of {under_load.request_id} ({drawn.fields}) differs: under load {outcome(under_load)}, "
                    f"alone {outcome(alone)}"
                )
            elif (drift := logprobs_drift(alone, under_load)) > LOGPROB_TOLERANCE:
                self.report.fail(f"replay of {under_load.request_id} ({drawn.fields}): logprobs {drift:.3g} off")


PROGRESS_EVERY_S = 5.0


async def _traffic_then_tail(traffic: asyncio.Future, deadline: float, phase: list[str], say, timeout: float) -> None:
    """Wait for the clients' loops; past the deadline, say that what is left is their last
    requests finishing (each may take up to ``timeout``), the part of a soak that runs over."""
    done, _ = await asyncio.wait({traffic}, timeout=max(0.0, deadline - time.monotonic()))
    if not done:
        phase[0] = f"traffic over: waiting for the clients' last requests (each up to --timeout {timeout:g} s)"
        say(f"soak: {phase[0]}")
    await traffic


async def soak(
    address: str,
    *,
    duration: float,
    clients: int,
    seed: int = 0,
    replay: int = 50,
    timeout: float = 120.0,
    mix: Mix | None = None,
    reload: tuple[str, str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Report:
    """Run the soak of the module docstring against ``address``; the report lists every failed
    check. ``mix``: the kinds drawn beyond plain requests; None: every kind, with the LoRA
    adapters the server's stats list. ``reload``: (name, directory) of an adapter the probes
    load and unload under load (the server runs with --enable-lora-loading), which ``mix``
    then names too; it is loaded for the replay. ``progress``: where a line goes every
    PROGRESS_EVERY_S and at each phase (traffic, its tail, the drain, the replay); None: nowhere."""
    if mix is None:
        async with AsyncClient(address, timeout=timeout) as client:
            mix = Mix.every_kind(tuple((await client.stats()).get("lora_adapters", ())))
    if reload:
        mix = dataclasses.replace(mix, loras=(*mix.loras, reload[0]))
    run = _Soak(address, timeout, mix, reload)
    say = progress or (lambda line: None)
    start = time.monotonic()
    deadline = start + duration
    phase = ["traffic"]

    async def tick() -> None:  # a line every PROGRESS_EVERY_S: the soak is alive and where it is
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            r = run.report
            where = (
                f"traffic, {max(0.0, deadline - time.monotonic()):.0f} s left" if phase[0] == "traffic" else phase[0]
            )
            replayed = f", {r.replayed} replayed" if r.replayed else ""
            say(
                f"soak: {time.monotonic() - start:.0f} s ({where}): {r.requests} requests{replayed}, "
                f"{len(r.failures)} failure(s)"
            )

    ticker = asyncio.ensure_future(tick())
    try:
        traffic = asyncio.gather(*(run.client_loop(i, seed, deadline) for i in range(clients)))
        await _traffic_then_tail(traffic, deadline, phase, say, timeout)
        async with AsyncClient(address, timeout=timeout) as client:
            phase[0] = "draining the server"
            say(f"soak: {phase[0]}")
            await run.drain(client)
            if reload:
                await run.toggle_lora(client, load=True)
            phase[0] = f"replaying up to {replay} requests alone"
            say(f"soak: {phase[0]}")
            await run.replay(client, random.Random(seed), replay)
    finally:
        ticker.cancel()
    return run.report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_address_arguments(p)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replay", type=int, default=50, help="greedy/seeded requests to replay alone afterwards")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a request may take before it counts as hung")
    p.add_argument("--plain", action="store_true", help="plain requests only: no n > 1, logprobs, constraints, LoRA")
    p.add_argument(
        "--lora-reload", metavar="NAME=DIR", help="an adapter to load and unload under load (--enable-lora-loading)"
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help=f"no progress lines on stderr (one every {PROGRESS_EVERY_S:g} s and at each phase)",
    )
    args = p.parse_args(argv)
    report = asyncio.run(
        soak(
            server_address(args),
            duration=args.duration,
            clients=args.clients,
            seed=args.seed,
            replay=args.replay,
            timeout=args.timeout,
            mix=Mix() if args.plain else None,
            reload=tuple(args.lora_reload.split("=", 1)) if args.lora_reload else None,
            progress=None if args.quiet else lambda line: print(line, file=sys.stderr, flush=True),
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
