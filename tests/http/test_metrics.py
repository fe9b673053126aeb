"""Prometheus metrics: :func:`conveyor.http.prometheus.exposition` parsed back with
``prometheus_client``'s own parser, and bin/serve's ``GET /metrics`` (on the API port and on
the metrics port) scraped during and after a run: counters move by what the requests' finals
report, and the gauges return to idle."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conveyor.client import Client
from conveyor.frontend.request_metrics import FrontendMetrics
from conveyor.frontend.tokenizer import Tokenizer
from conveyor.http.prometheus import exposition
from conveyor.protocol.replies import metrics_reply

STATS = {
    "num_running": 3,
    "num_waiting": 2,
    "num_swapped": 1,
    "held_blocks": 24,
    "free_blocks": 60,
    "cached_blocks": 12,
    "total_blocks": 96,
    "prefix_cache_queried_tokens": 500,
    "prefix_cache_hit_tokens": 128,
    "num_preemptions_swap": 4,
    "num_preemptions_recompute": 7,
    "spec_num_proposals": 10,
    "spec_proposed_tokens": 30,
    "spec_accepted_tokens": 17,
    "spec_accepted_per_position": [8, 6, 3],
    "spec_num_steps": 6,
    "spec_num_limited_steps": 2,
}


def parse(text: bytes, model: str | None = None) -> dict[str, dict[tuple, float]]:
    """Sample name -> {sorted label items but ``model_name``: value}; every sample must carry
    ``model_name`` (equal to ``model`` when given)."""
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            labels = dict(sample.labels)
            name = labels.pop("model_name", None)
            assert name is not None and (model is None or name == model), sample
            samples.setdefault(sample.name, {})[tuple(sorted(labels.items()))] = sample.value
    return samples


def family_types(text: bytes) -> dict[str, str]:
    return {family.name: family.type for family in text_string_to_metric_families(text.decode())}


def test_exposition_names_types_and_values() -> None:
    metrics = FrontendMetrics()
    metrics.add_prompt(11)
    metrics.observe_outputs([0, 0], 10**9)
    metrics.observe_outputs([10**9 - 4_000_000, 10**9 - 30_000_000], 10**9)  # gaps of 4 ms and 30 ms
    metrics.request_finished("length", {"queue_time": 0.002, "ttft": 0.05, "total": 0.5}, 2, 7, 2)
    metrics.request_finished("stop", {"queue_time": 0.004, "ttft": 3.0, "total": 3.0}, 1, 4, 300)
    metrics.clients_not_reading = 2
    stats = {**STATS, "iteration_token_counts": [3, 1] + [0] * 11 + [1], "iteration_token_sum": 3 + 8 + 20000}
    text = exposition(metrics_reply(**metrics.snapshot()), stats, "m")
    types = family_types(text)
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "num_requests_swapped",
        "kv_cache_usage_perc",
        "kv_blocks_used",
        "kv_blocks_free",
        "kv_blocks_cached",
    ):
        assert types["conveyor:" + name] == "gauge", name
    for name in (
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "prompt_tokens",
        "generation_tokens",
        "request_success",
        "clients_not_reading",
    ):
        assert types["conveyor:" + name] == "counter", name
    for name in (
        "time_to_first_token",
        "time_per_output_token",
        "inter_token_latency",
        "e2e_request_latency",
        "request_queue_time",
    ):
        assert types[f"conveyor:{name}_seconds"] == "histogram", name

    s = parse(text, "m")
    one = lambda name: s[name][()]  # noqa: E731 - an unlabelled sample
    assert (one("conveyor:num_requests_running"), one("conveyor:num_requests_waiting")) == (3, 2)
    assert one("conveyor:num_requests_swapped") == 1
    blocks = (one("conveyor:kv_blocks_used"), one("conveyor:kv_blocks_free"), one("conveyor:kv_blocks_cached"))
    assert blocks == (24, 60, 12)
    assert one("conveyor:kv_cache_usage_perc") == pytest.approx(0.25)
    assert (one("conveyor:prefix_cache_queries_total"), one("conveyor:prefix_cache_hits_total")) == (500, 128)
    assert s["conveyor:num_preemptions_total"] == {(("kind", "swap"),): 4, (("kind", "recompute"),): 7}
    assert (one("conveyor:prompt_tokens_total"), one("conveyor:generation_tokens_total")) == (11, 4)
    assert one("conveyor:clients_not_reading_total") == 2
    assert s["conveyor:request_success_total"] == {
        (("finished_reason", "stop"),): 1,
        (("finished_reason", "length"),): 1,
        (("finished_reason", "abort"),): 0,
        (("finished_reason", "error"),): 0,
    }
    itl = {dict(k)["le"]: v for k, v in s["conveyor:inter_token_latency_seconds_bucket"].items()}
    assert (itl["0.002"], itl["0.005"], itl["0.02"], itl["0.03"], itl["+Inf"]) == (0, 1, 1, 2, 2)  # cumulative
    assert one("conveyor:inter_token_latency_seconds_count") == 2
    assert one("conveyor:inter_token_latency_seconds_sum") == pytest.approx(0.034)
    ttft = {dict(k)["le"]: v for k, v in s["conveyor:time_to_first_token_seconds_bucket"].items()}
    assert (ttft["0.05"], ttft["2.0"], ttft["5.0"], ttft["+Inf"]) == (1, 1, 2, 2)
    assert one("conveyor:e2e_request_latency_seconds_sum") == pytest.approx(3.5)
    assert one("conveyor:time_per_output_token_seconds_count") == 1  # the one-token request has none
    # vLLM's per-request families: phases from the timing, token counts per request
    assert one("conveyor:request_prefill_time_seconds_sum") == pytest.approx(0.048 + 2.996)
    assert one("conveyor:request_decode_time_seconds_sum") == pytest.approx(0.45)
    assert one("conveyor:request_inference_time_seconds_sum") == pytest.approx(0.498 + 2.996)
    prompt = {dict(k)["le"]: v for k, v in s["conveyor:request_prompt_tokens_bucket"].items()}
    assert (prompt["2.0"], prompt["5.0"], prompt["10.0"]) == (0, 1, 2) and one(
        "conveyor:request_prompt_tokens_sum"
    ) == 11
    assert one("conveyor:request_generation_tokens_sum") == 3
    max_tokens = {dict(k)["le"]: v for k, v in s["conveyor:request_params_max_tokens_bucket"].items()}
    assert (max_tokens["2.0"], max_tokens["200.0"], max_tokens["500.0"]) == (1, 1, 2)
    iteration = {dict(k)["le"]: v for k, v in s["conveyor:iteration_tokens_total_bucket"].items()}
    assert (iteration["1.0"], iteration["8.0"], iteration["16384.0"], iteration["+Inf"]) == (3, 4, 4, 5)
    assert one("conveyor:iteration_tokens_total_sum") == 20011
    # the same values under vLLM's names, and vLLM's own total of preemptions
    for name, samples in list(s.items()):
        if name.startswith("conveyor:") and name.split(":", 1)[1].split("_bucket")[0] not in ("num_preemptions_total",):
            alias = "vllm:" + name.split(":", 1)[1]
            if alias in s:
                assert s[alias] == samples, name
    for name in (
        "num_requests_running",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "request_success_total",
        "time_to_first_token_seconds_bucket",
        "e2e_request_latency_seconds_count",
        "request_prompt_tokens_bucket",
        "iteration_tokens_total_bucket",
        "request_params_max_tokens_sum",
    ):
        assert s["vllm:" + name] == s["conveyor:" + name], name
    assert one("vllm:num_preemptions_total") == 11 and one("vllm:gpu_cache_usage_perc") == pytest.approx(0.25)
    assert "vllm:kv_blocks_used" not in s  # vLLM has no such family
    # speculative decoding, under vLLM's names too (per position: label "position", from 0)
    spec = (one("vllm:spec_decode_num_drafts_total"), one("vllm:spec_decode_num_draft_tokens_total"))
    assert spec == (10, 30) and one("vllm:spec_decode_num_accepted_tokens_total") == 17
    per_position = {(("position", str(i)),): v for i, v in enumerate([8, 6, 3])}
    assert s["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == per_position
    assert s["conveyor:spec_decode_num_accepted_tokens_per_pos_total"] == per_position
    assert (one("conveyor:spec_decode_num_steps_total"), one("conveyor:spec_decode_num_limited_steps_total")) == (6, 2)
    assert "vllm:spec_decode_num_steps_total" not in s


def test_exposition_without_the_scheduler_keeps_the_frontend_families() -> None:
    types = family_types(exposition(metrics_reply(**FrontendMetrics().snapshot()), None, "m"))
    assert "conveyor:prompt_tokens" in types and "conveyor:num_requests_running" not in types


# ------------------------------------------------------------------ bin/serve, end to end

ABORTED_PROMPT = "An aborted story"
SERVE_ARGS = ("--num-kv-blocks", "96", "--block-size", "8", "--threads", "1", "--max-num-batched-tokens", "256")


def scrape(base_url: str) -> dict[str, dict[tuple, float]]:
    """One ``GET /metrics``, parsed."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
        return parse(response.read())


def counters(s: dict[str, dict[tuple, float]]) -> dict[str, float]:
    """The counters and request counts this test follows, by a short name."""
    out = {
        "prompt": s["conveyor:prompt_tokens_total"][()],
        "generation": s["conveyor:generation_tokens_total"][()],
        "ttft": s["conveyor:time_to_first_token_seconds_count"][()],
        "e2e": s["conveyor:e2e_request_latency_seconds_count"][()],
        "itl": s["conveyor:inter_token_latency_seconds_count"][()],
    }
    for labels, value in s["conveyor:request_success_total"].items():
        out[dict(labels)["finished_reason"]] = value
    return out


def test_a_scrape_follows_a_run(http_factory, tiny_checkpoint) -> None:
    """Counters move by what the finals report (prompt and completion tokens, finishes by
    reason: length, stop, abort), scrapes taken while requests run see them in flight, and
    the gauges are back at idle (nothing running or waiting, no KV block held) after. Both
    listeners serve the same scrape."""
    server = http_factory("--model", str(tiny_checkpoint), *SERVE_ARGS, "--http-port", "0", "--metrics-port", "0")
    assert server.url and server.metrics_url
    with Client(server.address, timeout=60) as client:
        before = counters(scrape(server.url))
        assert before["prompt"] == before["generation"] == 0
        probe = client.generate("Once upon a time", max_tokens=6, temperature=0.0, ignore_eos=True)
        stop_id = probe.token_ids[3]  # greedy: the same request stops at this token
        expected_stop = probe.token_ids.index(stop_id) + 1

        results: list = []
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                with Client(server.address, timeout=60) as c:
                    results.append(c.generate(f"Request number {i} tells", max_tokens=48, ignore_eos=True))
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        during = []
        while any(t.is_alive() for t in threads):
            during.append(scrape(server.url))
            time.sleep(0.02)
        for t in threads:
            t.join()
        assert not errors, errors
        stopped = client.generate(
            "Once upon a time", max_tokens=6, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]
        )
        stream = client.stream(ABORTED_PROMPT, max_tokens=200, ignore_eos=True)
        first = next(stream)
        assert first.token_ids
        stream.close()  # abandons the request: the client aborts it

        deadline = time.monotonic() + 10
        while True:
            after = scrape(server.metrics_url)
            idle = (
                after["conveyor:num_requests_running"][()] == 0
                and after["conveyor:num_requests_waiting"][()] == 0
                and after["conveyor:kv_blocks_used"][()] == 0
                and counters(after)["abort"] == 1
            )
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.05)

    assert idle, after
    assert scrape(server.url) == after  # the API port's /metrics: the same values
    assert after["conveyor:num_requests_swapped"][()] == 0
    assert after["conveyor:kv_cache_usage_perc"][()] == 0
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == expected_stop
    moved = {k: v - before[k] for k, v in counters(after).items()}
    finals = [probe, *results, stopped]
    assert moved["length"] == 1 + len(results) == 9 and moved["stop"] == 1 and moved["error"] == 0
    assert moved["abort"] == 1
    # The aborted stream's prompt and tokens count too (its final went to nobody).
    aborted_prompt = len(Tokenizer.from_dir(tiny_checkpoint).encode(ABORTED_PROMPT))
    assert moved["prompt"] == sum(r.usage.prompt_tokens for r in finals) + aborted_prompt
    aborted_tokens = moved["generation"] - sum(len(r.token_ids) for r in finals)
    assert aborted_tokens >= len(first.token_ids)
    assert moved["ttft"] == moved["e2e"] == len(finals) + 1  # the abort got a final too
    assert moved["itl"] == moved["generation"] - (len(finals) + 1)  # n - 1 gaps per request

    in_flight = [s["conveyor:num_requests_running"][()] + s["conveyor:num_requests_waiting"][()] for s in during]
    assert max(in_flight) > 0  # a scrape saw requests in flight
    generation = [counters(s)["generation"] for s in during]
    assert generation == sorted(generation) and generation[-1] > generation[0]  # moved during the run


SPECULATIVE = ("--speculative-method", "ngram", "--num-speculative-tokens", "3", "--ngram-max", "3")


def spec_counters(s: dict[str, dict[tuple, float]]) -> dict[str, float]:
    out = {name: s[f"vllm:spec_decode_num_{name}_total"][()] for name in ("drafts", "draft_tokens", "accepted_tokens")}
    out["per_position"] = [v for _, v in sorted(s["vllm:spec_decode_num_accepted_tokens_per_pos_total"].items())]
    return out


def test_speculation_counters_rise_in_a_live_scrape(http_factory, tiny_checkpoint) -> None:
    """With speculative decoding on, greedy requests over prompts that repeat a phrase move
    the proposal counters between two scrapes; the per-position counts add up to the accepted
    tokens and never grow along the proposal; the stats reply's ratios match the counters."""
    server = http_factory("--model", str(tiny_checkpoint), *SERVE_ARGS, *SPECULATIVE, "--metrics-port", "0")
    before = spec_counters(scrape(server.metrics_url))
    assert before == {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "per_position": [0, 0, 0]}
    with Client(server.address, timeout=60) as client:
        for i in range(3):
            phrase = [7 * i + 3 * j + 5 for j in range(4)]
            client.generate(token_ids=phrase * 4, max_tokens=16, temperature=0.0, ignore_eos=True)
        stats = client.stats()
    after = spec_counters(scrape(server.metrics_url))
    assert after["drafts"] > 0 and after["draft_tokens"] >= after["drafts"]
    assert 0 < after["accepted_tokens"] <= after["draft_tokens"]
    assert sum(after["per_position"]) == after["accepted_tokens"]
    assert after["per_position"] == sorted(after["per_position"], reverse=True)
    assert (stats["spec_num_proposals"], stats["spec_accepted_tokens"]) == (after["drafts"], after["accepted_tokens"])
    assert stats["spec_acceptance_rate"] == pytest.approx(after["accepted_tokens"] / after["draft_tokens"])
    assert stats["spec_mean_acceptance_length"] == pytest.approx(1 + after["accepted_tokens"] / after["drafts"])
    assert stats["spec_proposals_per_step"] == pytest.approx(after["drafts"] / stats["spec_num_steps"])
